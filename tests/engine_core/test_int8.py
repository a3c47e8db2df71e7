"""--quantization int8: dynamic W8A8 linears, from a float checkpoint or from
a compressed-tensors int8 one (engine_core/loaders/compressed_tensors.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.loaders.compressed_tensors import dequantized_weights, load_int8_weights
from pagoda.engine_core.model_config import ModelLoadError
from pagoda.kernels.linear_int8 import int8_available, pack_int8
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.conftest import TINY_VOCAB_SIZE
from tests.engine_core.helpers import NUM_THREADS, greedy_params, run_to_completion
from tests.engine_core.test_sleep import check_sleep_cycle

pytestmark = pytest.mark.skipif(not int8_available(), reason="no AVX512-VNNI kernel here")

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _engine(path: Path, **args: object) -> EngineCore:
    config = EngineConfig(
        model=str(path),
        kv_cache_memory_bytes=4 << 20,
        max_model_len=64,
        num_threads=NUM_THREADS,
        **args,  # type: ignore[arg-type]
    )
    return EngineCore(config)


def _greedy(path: Path, prompts: list[list[int]], **args: object) -> list[list[int]]:
    engine = _engine(path, **args)
    requests = [AddRequest(str(i), p, greedy_params(16), 0.0) for i, p in enumerate(prompts)]
    run = run_to_completion(engine, requests)
    return [run.records[str(i)].token_ids for i in range(len(prompts))]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1, TINY_VOCAB_SIZE - 1) for _ in range(rng.randrange(4, 24))]
        for _ in range(6)
    ]


def _top1_agreement(
    path: Path, prompts: list[list[int]], reference: list[list[int]], **args: object
) -> float:
    """Teacher-forced: the share of the reference's generated positions at
    which this model's top token, given the reference's sequence so far, is
    the reference's token (so one near-tie does not derail the rest)."""
    engine = _engine(path, **args)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    requests = [
        AddRequest(str(i), p + r, params, 0.0)
        for i, (p, r) in enumerate(zip(prompts, reference, strict=True))
    ]
    run = run_to_completion(engine, requests)
    same = total = 0
    for i, (p, r) in enumerate(zip(prompts, reference, strict=True)):
        logprobs = run.records[str(i)].prompt_logprobs
        assert logprobs is not None
        for j, token in enumerate(r, start=len(p)):
            position = logprobs[j]
            assert position is not None
            same += position.token_ids[1] == token  # [0] is the prompt's token, [1] the top one
            total += 1
    return same / total


def _compressed_checkpoint(src: Path, dst: Path, max_code: int = 100) -> dict[str, torch.Tensor]:
    """src (a float checkpoint) rewritten in the compressed-tensors W8A8 layout:
    each decoder linear's weight int8 per channel, codes up to max_code (not
    127, so that the loader's ints can be told from a re-quantization of the
    dequantized weights), with its weight_scale [out, 1]. Returns the dequantized
    weights by name."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in _LINEARS:
            scale = t.abs().amax(dim=1, keepdim=True) / max_code  # [out, 1]
            q = torch.round(t / scale).clamp(-max_code, max_code).to(torch.int8)
            out[name] = q
            out[name + "_scale"] = scale
            dequantized[name] = q.float() * scale
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**scheme, "strategy": "channel"},
                "input_activations": {**scheme, "strategy": "token", "dynamic": True},
                "output_activations": None,
            }
        },
    }
    (dst / "config.json").write_text(json.dumps(config))
    for extra in src.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            (dst / extra.name).write_bytes(extra.read_bytes())
    return dequantized


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_greedy_tracks_the_float_model(tiny_models: dict[str, Path], dtype: str) -> None:
    """The int8 model's top token along float32's greedy sequences (teacher-
    forced, _top1_agreement). The linears' outputs differ from float by ~1%
    (steps of 1/127 of each row's and each channel's largest value), and a
    random tiny model has many near-ties among its 1000 logits: measured
    over prompt seeds 3, 5, 7, plain bfloat16 agrees with float32 on 0.96-0.98
    of positions and int8 on 0.92-0.96 (float32 and bfloat16 activations).
    0.8 leaves room for that spread; a wrong linear (a transposed, unscaled or
    misplaced weight) agrees on next to none (chance: 1 in 1000)."""
    prompts = _prompts(3)
    reference = _greedy(tiny_models["llama"], prompts, dtype="float32")
    agreement = _top1_agreement(
        tiny_models["llama"], prompts, reference, dtype=dtype, quantization="int8"
    )
    print(f"int8 ({dtype}) vs float32 top-1 agreement: {agreement:.3f}")
    assert agreement >= 0.8


def test_compressed_tensors_checkpoint(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A compressed-tensors W8A8 checkpoint loads: without --quantization as its
    dequantized float model exactly, with it on its own int8 weights."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "w8a8"
    dequantized = _compressed_checkpoint(tiny_models["llama"], path)
    # The loader's dense pairs are exactly q * scale.
    pairs = dict(dequantized_weights(load_file(str(path / "model.safetensors")).items()))
    for name, w in dequantized.items():
        assert torch.equal(pairs[name], w), name
    # The same model as a plain float checkpoint.
    plain = tmp_path / "dequantized"
    plain.mkdir()
    save_file(pairs, str(plain / "model.safetensors"))
    for extra in tiny_models["llama"].iterdir():
        if extra.name != "model.safetensors":
            (plain / extra.name).write_bytes(extra.read_bytes())

    prompts = _prompts(5)
    reference = _greedy(plain, prompts, dtype="float32")
    assert _greedy(path, prompts, dtype="float32") == reference
    agreement = _top1_agreement(path, prompts, reference, dtype="float32", quantization="int8")
    print(f"compressed-tensors int8 vs its dequantized float32 model: {agreement:.3f}")
    assert agreement >= 0.8  # as in test_int8_greedy_tracks_the_float_model

    # The linears run on the stored codes (at most 100), not on re-quantized ones.
    stored = load_int8_weights(str(path))
    model = _engine(path, dtype="float32", quantization="int8").executor.worker.runner.model  # type: ignore[attr-defined]
    layer = model.layers[1]
    q, s = stored["model.layers.1.mlp.down_proj.weight"]
    assert int(q.abs().max()) <= 100
    assert layer.down_proj.int8 is not None
    assert torch.equal(layer.down_proj.int8.packed, pack_int8(q, s).packed)


def test_compressed_tensors_refuses_static_activation_scales(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / "static"
    _compressed_checkpoint(tiny_models["llama"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(
        dynamic=False, strategy="tensor"
    )
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="dynamic, per token"):
        _engine(path, dtype="float32")


def test_sleep_restores_the_int8_weights(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Level 1 parks the packed int8 tensors with the rest and puts them back;
    level 2 quantizes them again at reload: the same outputs after each."""
    config = EngineConfig(
        model=str(tiny_models["llama"]),
        dtype="bfloat16",
        quantization="int8",
        kv_cache_memory_bytes=1 << 20,
        num_threads=NUM_THREADS,
        sleep_offload_dir=str(tmp_path),
    )
    engine = EngineCore(config)
    layer = engine.executor.worker.runner.model.layers[0]  # type: ignore[attr-defined]
    assert layer.qkv_proj.int8 is not None and layer.down_proj.int8 is not None
    check_sleep_cycle(engine, tmp_path)
