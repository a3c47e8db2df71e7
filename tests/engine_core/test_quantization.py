"""--quantization gguf: steps of up to 6 tokens run on the GGUF file's own 4-bit
weights (the default model is Q4_1), larger ones on the dense copy."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.loaders.gguf import gguf_weights, load_int4_weights
from pagoda.engine_core.model_config import ModelLoadError, default_model_path, load_model_config
from pagoda.kernels.linear import int4_available
from tests.engine_core.helpers import NUM_THREADS, assert_answers_paris
from tests.engine_core.test_sleep import check_sleep_cycle

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not int4_available(), reason="torch has no CPU int4 matmul"),
]


def test_int4_weights_are_exactly_the_dequantized_ones() -> None:
    config = load_model_config(default_model_path())
    dense = dict(gguf_weights(config))
    int4 = load_int4_weights(config)
    # 30 layers x q, k, v, o, gate, up, down: every linear of the default model
    assert len(int4) == 7 * config.num_layers
    for name, (q, scale, zero) in int4.items():
        assert q.dtype == torch.uint8 and int(q.max()) <= 15
        group = q.shape[1] // scale.shape[1]
        values = (q.float() - 8).view(q.shape[0], -1, group) * scale[..., None] + zero[..., None]
        assert torch.equal(values.view(q.shape), dense[name]), name


def test_int4_needs_a_gguf_model(tiny_models: dict[str, Path]) -> None:
    config = load_model_config(str(tiny_models["llama"]))
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_int4_weights(config)


def test_gguf_quantization_tracks_float32_engine() -> None:
    """Decode of one sequence at a time runs on the 4-bit weights (prefill on
    the dense ones): where float32's top token wins clearly, it is the same."""
    rng = random.Random(11)
    prompts = [[rng.randrange(100, 49152) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outputs = {}
    for name, args in {
        "float32": {"dtype": "float32"},
        "gguf": {"dtype": "bfloat16", "quantization": "gguf"},
    }.items():
        llm = LLM(kv_cache_memory_bytes=64 << 20, max_model_len=512, **args)
        outputs[name] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        assert_answers_paris(llm)
        del llm
    compared = 0
    for full, quant in zip(outputs["float32"], outputs["gguf"], strict=True):
        assert full.logprobs is not None and quant.logprobs is not None
        for i, (a, b) in enumerate(zip(full.token_ids, quant.token_ids, strict=True)):
            top = sorted((lp.logprob for lp in full.logprobs[i].values()), reverse=True)
            if top[0] - top[1] > 0.3:
                assert a == b, (i, full.token_ids, quant.token_ids)
                compared += 1
            if a != b:
                break  # the sequences have diverged on a near tie
    assert compared >= 16


def test_sleep_restores_the_4bit_weights(tmp_path: Path) -> None:
    """Level 1 parks the packed 4-bit tensors with the rest and puts them back
    byte for byte; level 2 reloads them from the file."""
    config = EngineConfig(
        dtype="bfloat16",
        quantization="gguf",
        kv_cache_memory_bytes=16 << 20,
        max_model_len=256,
        num_threads=NUM_THREADS,
        sleep_offload_dir=str(tmp_path),
    )
    engine = EngineCore(config)
    layer = engine.executor.worker.runner.model.layers[0]
    assert layer.qkv_proj.int4 is not None and layer.down_proj.int4 is not None
    check_sleep_cycle(engine, tmp_path)  # decode of 2 sequences: the 4-bit path
