"""Weight updates from a real trainer process, pause / resume, weight versions.

The trainer (tests/engine_core/trainer.py) perturbs a tiny model's weights
and broadcasts them over a gloo group of its own; afterwards the engine's
greedy tokens are transformers' on the perturbed weights, its checksums are
the trainer's, and outputs name the new weight version. The same through
the file backend and at two tensor-parallel ranks. A bad update is refused
whole, naming the tensor, and the old weights keep serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import NUM_THREADS, random_prompts, run_to_completion
from tests.engine_core.hf_reference import hf_greedy
from tests.engine_core.test_mp_executor import free_ports

pytestmark = pytest.mark.slow
TRAINER = Path(__file__).resolve().parent / "trainer.py"
PROMPTS = random_prompts(21, 3, 1000, 4, 20)


def engine_for(model: Path, tp: int = 1, **overrides: Any) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model),
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            num_threads=NUM_THREADS,
            tensor_parallel_size=tp,
            **overrides,
        )
    )


def greedy(engine: EngineCore, tag: str, max_tokens: int = 8) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    adds = [AddRequest(f"{tag}{i}", p, params, 0.0) for i, p in enumerate(PROMPTS)]
    return run_to_completion(engine, adds).records


def start_trainer(
    model: Path, out: Path, world_size: int, packed: int = 0
) -> tuple[subprocess.Popen[bytes], int, dict[str, Any]]:
    port = free_ports(1)
    # Run as a plain script from elsewhere: the trainer imports nothing of Pagoda's.
    trainer = subprocess.Popen(
        [
            sys.executable,
            str(TRAINER),
            str(model),
            str(out),
            str(port),
            str(world_size),
            "--packed",
            str(packed),
        ],
        cwd=out.parent,
    )
    deadline = time.monotonic() + 120
    while not (out / "update.json").exists():
        assert trainer.poll() is None, "the trainer failed"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.2)  # the file is written whole before the store opens; give it a moment
    return trainer, port, json.loads((out / "update.json").read_text())


@pytest.mark.parametrize(("tp", "packed"), [(1, 0), (2, 0), (1, 20000)])
def test_a_trainer_broadcasts_new_weights(
    tiny_models: dict[str, Path], tmp_path: Path, tp: int, packed: int
) -> None:
    """Tensor by tensor at one and two ranks; packed into ~20 kB buffers
    (several tensors each, and tensors bigger than a buffer)."""
    model = tiny_models["llama"]
    engine = engine_for(model, tp)
    try:
        before = greedy(engine, "a")
        trainer, port, sent = start_trainer(model, tmp_path / "perturbed", 1 + tp, packed)
        try:
            assert engine.init_weight_transfer_engine(
                {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 1 + tp,
                }
            )
            result = engine.update_weights(sent["update_info"])
            assert trainer.wait(60) == 0
        finally:
            if trainer.poll() is None:
                trainer.kill()
        assert result == {"num_tensors": len(sent["update_info"]["names"]), "weight_version": 1}
        after = greedy(engine, "b")
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "perturbed", dtype=torch.float32)
        expected = hf_greedy(hf, PROMPTS, 8)
        for i, tokens in enumerate(expected):
            assert after[f"b{i}"].token_ids == tokens, i
        assert any(before[f"a{i}"].token_ids != tokens for i, tokens in enumerate(expected))
        checks = engine.weight_checker("checksum")
        assert checks["weight_version"] == 1
        for name, digest in sent["checksums"].items():
            assert checks["checksums"][name] == digest, name
        compared = engine.weight_checker("compare", sent["checksums"])
        assert compared["match"] and compared["mismatched"] == compared["unknown"] == []
        wrong = {**sent["checksums"], "model.norm.weight": "0" * 64, "model.nope": "1"}
        compared = engine.weight_checker("compare", wrong)
        assert not compared["match"]
        assert compared["mismatched"] == ["model.norm.weight"] and compared["unknown"] == [
            "model.nope"
        ]
    finally:
        engine.shutdown()


def test_file_backend_bad_updates_and_weight_versions(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model = tiny_models["llama"]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        for _, param in hf.named_parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    hf.save_pretrained(tmp_path / "new")
    engine = engine_for(model, weight_transfer_backend="file")
    try:
        before = greedy(engine, "a")
        # Refused whole, naming the tensor: the old weights keep serving.
        with pytest.raises(
            ValueError, match="model.layers.9.mlp.up_proj.weight: the model has no such tensor"
        ):
            torch.save({}, tmp_path / "unused")
            from safetensors.torch import save_file

            bad = {
                "model.norm.weight": torch.ones(64),
                "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2),
            }
            save_file(bad, tmp_path / "bad.safetensors")
            engine.update_weights({"path": str(tmp_path / "bad.safetensors")})
        with pytest.raises(ValueError, match=r"model.norm.weight: shape \[3\] does not match"):
            save_file({"model.norm.weight": torch.ones(3)}, tmp_path / "bad2.safetensors")
            engine.update_weights({"path": str(tmp_path / "bad2.safetensors")})
        with pytest.raises(ValueError, match="not a file or directory"):
            engine.update_weights({"path": str(tmp_path / "nowhere")})
        again = greedy(engine, "c")
        assert [again[f"c{i}"].token_ids for i in range(3)] == [
            before[f"a{i}"].token_ids for i in range(3)
        ]
        assert engine.weight_info() == {"weight_version": 0}

        # A request running across the update: its tokens name both versions.
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert engine.add_request(AddRequest("across", PROMPTS[0], params, 0.0)) is None
        deltas = []
        for _ in range(5):
            deltas += engine.step()
        engine.start_weight_update()
        engine.update_weights({"path": str(tmp_path / "new"), "names": None})
        assert engine.finish_weight_update("v2") == {"weight_version": "v2"}
        while engine.has_work():
            deltas += engine.step()
        last = [d for _, d in deltas if d.request_id == "across"][-1]
        produced = sum(len(d.new_token_ids) for _, d in deltas if d.request_id == "across")
        assert produced == 12
        (v0, s0, e0), (v1, s1, e1) = last.weight_versions
        assert (v0, s0) == (0, 0) and (v1, e1) == ("v2", 12) and e0 == s1 > 0

        after = greedy(engine, "d")
        expected = hf_greedy(hf, PROMPTS, 8)
        assert [after[f"d{i}"].token_ids for i in range(3)] == expected
    finally:
        engine.shutdown()


def test_pause_modes(tiny_models: dict[str, Path]) -> None:
    engine = engine_for(tiny_models["llama"])
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        # keep: frozen, then every request continues to the tokens it would have made.
        for i, prompt in enumerate(PROMPTS):
            assert engine.add_request(AddRequest(f"k{i}", prompt, params, 0.0)) is None
        tokens: dict[str, list[int]] = {}
        for _ in range(3):
            for _, d in engine.step():
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        engine.pause("keep")
        assert not engine.has_work() and engine.step() == []
        assert engine.add_request(AddRequest("late", PROMPTS[0], params, 0.0)) is None
        assert engine.pause_state() == {"is_paused": True, "mode": "keep", "num_unfinished": 3}
        engine.resume()
        while engine.has_work():
            for _, d in engine.step():
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        expected = greedy(engine, "x", 20)
        for i in range(3):
            assert tokens[f"k{i}"] == expected[f"x{i}"].token_ids
        assert tokens["late"] == expected["x0"].token_ids

        # abort: partial outputs end with "abort"; new requests are held until resume.
        for i, prompt in enumerate(PROMPTS):
            assert engine.add_request(AddRequest(f"a{i}", prompt, params, 0.0)) is None
        engine.step()
        engine.step()
        engine.pause("abort")
        assert engine.add_request(AddRequest("held", PROMPTS[1], params, 0.0)) is None
        ended = engine.step()
        assert sorted(d.request_id for _, d in ended) == ["a0", "a1", "a2"]
        assert all(d.finish_reason == "abort" for _, d in ended)
        assert not engine.has_work()
        engine.resume()
        done = []
        while engine.has_work():
            done += [d for _, d in engine.step() if d.request_id == "held"]
        assert done[-1].finish_reason == "length"
        assert (
            engine.scheduler.block_manager.num_free_blocks
            == engine.scheduler.block_manager.num_blocks
        )
    finally:
        engine.shutdown()


def test_a_request_held_past_the_bound_fails_as_unavailable(tiny_models: dict[str, Path]) -> None:
    engine = engine_for(tiny_models["llama"], paused_request_timeout_s=0.3)
    try:
        engine.pause("keep")
        params = SamplingParams(temperature=0, max_tokens=4)
        assert engine.add_request(AddRequest("held", PROMPTS[0], params, 0.0)) is None
        assert not engine.has_work()  # nothing to do until resume or the bound
        time.sleep(0.4)
        assert engine.has_work()
        (_, delta), *_ = engine.step()
        assert delta.finish_reason == "error" and delta.error_kind == "paused"
        assert "paused" in (delta.error or "")
        assert engine.scheduler.requests == {}
    finally:
        engine.shutdown()


def test_weights_sent_while_asleep_are_there_on_wake_up(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """An RL loop's order: sleep (level 2 drops the weights), update, wake up."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    with torch.no_grad():
        for _, param in hf.named_parameters():
            param.mul_(1.2)
    hf.save_pretrained(tmp_path / "new")
    engine = engine_for(tiny_models["llama"], weight_transfer_backend="file")
    try:
        for level in (1, 2):
            engine.sleep(level)
            engine.update_weights({"path": str(tmp_path / "new")})
            engine.wake_up()
            after = greedy(engine, f"w{level}-")
            expected = hf_greedy(hf, PROMPTS, 8)
            assert [after[f"w{level}-{i}"].token_ids for i in range(3)] == expected
    finally:
        engine.shutdown()
