"""The RL-training routes over HTTP: pause modes under live streaming load,
weight updates from a real trainer process, auth, and their absence by default."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda.frontend.api.serving_rl import RL_PATHS
from pagoda.protocol.addresses import dp_addresses
from tests.engine_core.hf_reference import hf_greedy
from tests.engine_core.test_mp_executor import free_ports
from tests.engine_core.test_weight_transfer import TRAINER
from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME, Server
from tests.frontend.fuzzing import fuzz_all
from tests.frontend.servers import (
    Processes,
    api_argv,
    engine_argv,
    free_port,
    private_server,
    wait_healthy,
)
from tests.frontend.test_lora_sdk import add_word_tokenizer

pytestmark = pytest.mark.slow
ADMIN = {"Authorization": "Bearer admin-secret"}
# The ids of the streams started so far (their first event's `id`), and those already used.
STREAM_IDS: list[str] = []
SEEN_IDS: set[str] = set()


def test_rl_routes_are_absent_by_default(server: Server) -> None:
    assert httpx.post(server.base_url + "/pause").status_code == 404
    assert httpx.post(server.base_url + "/update_weights", json={}).status_code == 404


def stream_completion(base: str, prompt: str, max_tokens: int, out: dict[str, Any]) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, finish = [], None
    seen_id = False
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=ADMIN, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if not seen_id:
                    STREAM_IDS.append(event["id"])
                    seen_id = True
                choice = event["choices"][0]
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
    out[prompt] = ("".join(text), finish)


def live_load(base: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], dict[str, Any]]:
    out: dict[str, Any] = {}
    threads = [
        threading.Thread(target=stream_completion, args=(base, f"Story {i}: once", max_tokens, out))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    return threads, out


def wait_running(base: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(base + "/stats", headers=ADMIN).json().get("num_running", 0) < n:
        assert time.monotonic() < deadline, "the load never started"
        time.sleep(0.05)


def wait_tokens_flowing(base: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = httpx.get(base + "/stats", headers=ADMIN).json()
        if stats.get("num_running", 0) >= 8:
            return
        time.sleep(0.05)
    raise AssertionError("the load never started")


def test_pause_modes_under_streaming_load(tmp_path: Path) -> None:
    flags = ("--enable-rl-api", "--admin-api-key", "admin-secret", "--api-key", "admin-secret")
    with private_server(tmp_path, ENGINE_FLAGS, *flags, name="rl") as base:
        assert httpx.post(base + "/pause").status_code == 401  # the admin key is needed
        assert httpx.get(base + "/is_paused", headers=ADMIN).json() == {"is_paused": False}
        bad = httpx.post(base + "/pause?mode=sideways", headers=ADMIN)
        assert bad.status_code == 400 and "mode" in bad.text

        # The tokens each request makes without a pause.
        threads, plain = live_load(base, 16, 24)
        for t in threads:
            t.join(120)

        # keep: frozen mid-stream, then each request makes exactly those tokens.
        threads, kept = live_load(base, 16, 24)
        wait_tokens_flowing(base)
        paused = httpx.post(base + "/pause?mode=keep", headers=ADMIN)
        assert paused.json() == {"status": "paused"}
        assert httpx.get(base + "/is_paused", headers=ADMIN).json() == {"is_paused": True}
        time.sleep(0.5)
        assert all(t.is_alive() for t in threads)  # frozen, not failed
        assert httpx.post(base + "/resume", headers=ADMIN).json() == {"status": "resumed"}
        for t in threads:
            t.join(120)
        assert kept == plain

        # abort: at once, partial outputs ending "abort"; new requests wait for resume.
        threads, aborted = live_load(base, 16, 400)
        wait_tokens_flowing(base)
        started = time.monotonic()
        assert httpx.post(base + "/pause?mode=abort", headers=ADMIN).status_code == 200
        for t in threads:
            t.join(30)
        assert time.monotonic() - started < 10
        assert len(aborted) == 16 and all(f == "abort" for _, f in aborted.values())
        assert all(0 < len(text) for text, _ in aborted.values())
        held: dict[str, Any] = {}
        late = threading.Thread(target=stream_completion, args=(base, "Story 0: once", 24, held))
        late.start()
        time.sleep(0.5)
        assert late.is_alive() and not held  # waiting, not failed
        httpx.post(base + "/resume", headers=ADMIN)
        late.join(60)
        assert held["Story 0: once"] == plain["Story 0: once"]

        # /abort_requests by the response's id: that stream ends, the rest go on.
        SEEN_IDS.update(STREAM_IDS)
        threads, out = live_load(base, 2, 400)
        wait_running(base, 2)
        ids: list[str] = []
        deadline = time.monotonic() + 30
        while len(ids) < 1 and time.monotonic() < deadline:
            ids = [i for i in STREAM_IDS if i not in SEEN_IDS]
            time.sleep(0.05)
        SEEN_IDS.update(ids)
        r = httpx.post(base + "/abort_requests", json={"request_ids": ids[:1]}, headers=ADMIN)
        assert r.json() == {"status": "aborted", "aborted": 1}
        r = httpx.post(base + "/abort_requests", json={"request_ids": "x"}, headers=ADMIN)
        assert r.status_code == 400
        httpx.post(base + "/pause?mode=abort", headers=ADMIN)
        for t in threads:
            t.join(30)
        httpx.post(base + "/resume", headers=ADMIN)
        assert sorted(f for _, f in out.values()) == ["abort", "abort"]

        # wait: answered once every admitted request finished; new ones held meanwhile.
        # All 16 are admitted (each streamed its first token) before the pause; once it
        # answers, every stream ends at once and whole (a `keep` would leave them hanging,
        # an `abort` would cut them short).
        first = len(STREAM_IDS)
        threads, waited = live_load(base, 16, 24)
        deadline = time.monotonic() + 60
        while len(STREAM_IDS) - first < 16:
            assert time.monotonic() < deadline, "the load never started"
            time.sleep(0.02)
        assert httpx.post(base + "/pause?mode=wait", headers=ADMIN, timeout=120).status_code == 200
        assert httpx.get(base + "/stats", headers=ADMIN).json().get("num_running", 0) == 0
        for t in threads:
            t.join(10)
        assert waited == plain
        held = {}
        late = threading.Thread(target=stream_completion, args=(base, "Story 1: once", 24, held))
        late.start()
        time.sleep(0.5)
        assert late.is_alive() and not held
        httpx.post(base + "/resume", headers=ADMIN)
        late.join(60)
        assert held["Story 1: once"] == plain["Story 1: once"]


@contextmanager
def rl_server(directory: Path, flags: tuple[str, ...], dp: int) -> Iterator[str]:
    """`dp` engine cores and one API server with the RL routes; yields the base URL."""
    addresses = dp_addresses(f"ipc://{directory}/engine", dp)
    procs = Processes()
    for i, address in enumerate(addresses):
        procs.start(engine_argv(address, *flags, "--num-threads", "1"), f"engine-rl{i}")
    port = free_port()
    procs.start(api_argv(",".join(addresses), port, "--enable-rl-api"), "api-rl")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs)
        yield base
    finally:
        procs.stop()


@pytest.mark.parametrize("dp", [1, 2])
def test_weight_update_from_a_trainer_over_http(
    tiny_models: dict[str, Path], tmp_path: Path, dp: int
) -> None:
    """One engine, or two data-parallel engines taking consecutive ranks."""
    # The tiny model with a word-level tokenizer over its vocabulary.
    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model)
    add_word_tokenizer(model)
    flags = ("--model", str(model), "--dtype", "float32", "--kv-cache-memory-bytes", str(8 << 20))
    prompts = [[5, 17, 300, 42, 9], [800, 3, 3, 77]]
    (tmp_path / "srv").mkdir()
    with rl_server(tmp_path / "srv", flags, dp) as base:
        out = tmp_path / "perturbed"
        port = free_ports(1)
        trainer = subprocess.Popen(
            [sys.executable, str(TRAINER), str(model), str(out), str(port), str(1 + dp)],
            cwd=tmp_path,
        )
        try:
            deadline = time.monotonic() + 120
            while not (out / "update.json").exists():
                assert trainer.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(0.2)
            sent = json.loads((out / "update.json").read_text())
            assert httpx.get(base + "/get_world_size").json() == {"world_size": dp}
            fresh = {"model": str(model), "prompt": "w5 w6", "max_tokens": 2, "temperature": 0}
            choice = httpx.post(base + "/v1/completions", json=fresh, timeout=60).json()
            assert "weight_versions" not in choice["choices"][0]  # no update yet
            init = {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 1 + dp,
            }
            r = httpx.post(
                base + "/init_weight_transfer_engine", json={"init_info": init}, timeout=120
            )
            assert r.json() == {"message": "Weight transfer initialized"}, r.text
            r = httpx.post(
                base + "/update_weights", json={"update_info": sent["update_info"]}, timeout=120
            )
            assert r.status_code == 200, r.text
            assert r.json()["weight_version"] == 1
            assert trainer.wait(60) == 0
        finally:
            if trainer.poll() is None:
                trainer.kill()
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        expected = hf_greedy(hf, prompts, 6)
        body = {
            "model": str(model),
            "prompt": prompts,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        got = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        # The word tokenizer's text names the token ids: "w608 w517 ...".
        for choice, tokens in zip(got["choices"], expected, strict=True):
            assert [int(w[1:]) for w in choice["text"].split()] == tokens
            assert choice["weight_versions"] == [{"version": 1, "start": 0, "end": 6}]
        checks = httpx.post(base + "/weight_checker", json={"action": "checksum"}).json()
        assert checks["checksums"] == {**checks["checksums"], **sent["checksums"]}
        assert httpx.get(base + "/weight_info").json() == {"weight_version": 1}
        # A name the model does not have: 400 naming it, the weights untouched.
        r = httpx.post(
            base + "/update_weights",
            json={"update_info": {"path": str(out), "names": ["model.nope.weight"]}},
        )
        assert r.status_code == 400 and "model.nope.weight" in r.text
        r = httpx.post(base + "/update_weights", json={"update_info": "x"})
        assert r.status_code == 400
        again = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        assert [c["text"] for c in again["choices"]] == [c["text"] for c in got["choices"]]


def test_fuzz_the_rl_routes(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model)
    add_word_tokenizer(model)
    flags = ("--model", str(model), "--dtype", "float32", "--kv-cache-memory-bytes", str(8 << 20))
    (tmp_path / "srv").mkdir()
    with private_server(tmp_path / "srv", flags, "--enable-rl-api", name="rlf") as base:
        # Nothing listens here: a clear 400 at once, not a store waiting minutes.
        init = {"master_address": "127.0.0.1", "master_port": free_ports(1), "world_size": 2}
        started = time.monotonic()
        r = httpx.post(base + "/init_weight_transfer_engine", json={"init_info": init}, timeout=60)
        assert r.status_code == 400 and "not reachable" in r.text
        assert time.monotonic() - started < 15
        for bad in ([], {"init_info": 3}, {"init_info": {"master_port": "x"}}):
            r = httpx.post(base + "/init_weight_transfer_engine", json=bad, timeout=60)
            assert r.status_code == 400, (bad, r.text)
        r = httpx.post(base + "/update_weights", json={"update_info": {"names": ["a"]}})
        assert r.status_code == 400
        results = fuzz_all(base, 3, routes=sorted(RL_PATHS))
        assert len(results) >= len(RL_PATHS)
        problems = [f"{r.route}: {p}" for r in results for p in r.problems]
        assert not problems, "\n".join(problems[:10])
        assert sum(r.server_errors for r in results) == 0
        assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_the_sdk_rl_methods(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """LLM.pause_generation / resume_generation / update_weights / collective_rpc."""
    from pagoda import LLM, SamplingParams

    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model)
    add_word_tokenizer(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        for _, param in hf.named_parameters():
            param.mul_(1.1)
    hf.save_pretrained(tmp_path / "new")
    llm = LLM(str(model), dtype="float32", kv_cache_memory_bytes=8 << 20)
    llm.pause_generation("keep")
    assert llm.is_paused()
    llm.resume_generation()
    assert not llm.is_paused()
    assert llm.update_weights({"path": str(tmp_path / "new")}) == {
        "num_tensors": len(list(hf.named_parameters())),
        "weight_version": 1,
    }
    assert [info.rank for info in llm.collective_rpc("describe")] == [0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(hf, [[5, 6, 7]], 5)[0]
    assert out.weight_versions == [{"version": 1, "start": 0, "end": 5}]
    llm.pause_generation("wait")  # nothing running: at once
