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
