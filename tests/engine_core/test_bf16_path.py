"""The serving configuration (bfloat16: packed linears, fused and compiled CPU kernels)
against the float32 engine, whose parity with transformers is tested token for token."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from tests.engine_core.helpers import assert_answers_paris

pytestmark = pytest.mark.slow


def test_bf16_engine_tracks_float32_engine() -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49152) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, kv_cache_memory_bytes=64 << 20, max_model_len=512)
        results[dtype] = llm.generate(prompts, params, use_tqdm=False)
        assert_answers_paris(llm)
        del llm
    diffs = []
    for full, half in zip(results["float32"], results["bfloat16"], strict=True):
        a, b = full.outputs[0], half.outputs[0]
        assert a.logprobs is not None and b.logprobs is not None
        top = sorted((lp.logprob for lp in a.logprobs[0].values()), reverse=True)
        if top[0] - top[1] > 0.3:  # a clear winner must survive bfloat16 rounding
            assert a.token_ids[0] == b.token_ids[0]
        diffs.append(
            abs(a.logprobs[0][a.token_ids[0]].logprob - b.logprobs[0][b.token_ids[0]].logprob)
        )
    # bfloat16 keeps ~3 significant digits: a few tenths on a logprob is its noise.
    assert max(diffs) < 0.4 and sum(diffs) / len(diffs) < 0.15, diffs


def test_long_prompt_chunks_in_the_dense_kernel_track_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt chunks past the compiled paged kernel's reach (context over 256)
    run in the dense bfloat16 attention kernel; the same engine with torch's
    SDPA there instead gives the same clear winners and near logprobs."""
    from pagoda.kernels import cpu_ops

    if not cpu_ops.has_bf16_dense_attention():
        pytest.skip("the dense attention kernel needs AVX512-BF16")
    rng = random.Random(11)
    prompts = [
        [rng.randrange(100, 49152) for _ in range(rng.randrange(600, 1000))] for _ in range(3)
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    results = {}
    calls = []
    kernel = cpu_ops.dense_attention
    monkeypatch.setattr(
        cpu_ops, "dense_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    for dense in (True, False):
        if not dense:
            assert calls, "no prompt chunk reached the dense kernel"
            monkeypatch.setattr(cpu_ops, "has_bf16_dense_attention", lambda: False)
        llm = LLM(
            dtype="bfloat16",
            kv_cache_memory_bytes=64 << 20,
            max_model_len=1024,
            max_num_batched_tokens=256,  # chunks whose context reaches 1000 positions
        )
        results[dense] = llm.generate(prompts, params, use_tqdm=False)
        del llm
    for kernel, sdpa in zip(results[True], results[False], strict=True):
        a, b = kernel.outputs[0], sdpa.outputs[0]
        assert a.logprobs is not None and b.logprobs is not None
        top = sorted((lp.logprob for lp in b.logprobs[0].values()), reverse=True)
        if top[0] - top[1] > 0.3:
            assert a.token_ids[0] == b.token_ids[0]
        first = b.token_ids[0]
        if first in a.logprobs[0]:
            assert abs(a.logprobs[0][first].logprob - b.logprobs[0][first].logprob) < 0.15
