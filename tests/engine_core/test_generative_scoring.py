"""SamplingParams.logprob_token_ids: chosen tokens' full-vocabulary logprobs at sampled positions.

The values the engine returns are compared with HF transformers'
log_softmax on the same prompts (float32, a tiny random-weight Llama); they
come from the raw distribution, so temperature, penalties and logit bias do
not move them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.protocol.messages import AddRequest, Logprobs
from pagoda.protocol.sampling_params import (
    MAX_LOGPROB_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)
from tests.conftest import TINY_VOCAB_SIZE
from tests.engine_core.helpers import NUM_THREADS, random_prompts, run_to_completion
from tests.engine_core.hf_reference import hf_logprobs

ATOL = 1e-4
LABELS = [3, 517, 998, 42]


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> EngineCore:
    torch.set_num_threads(NUM_THREADS)
    config = EngineConfig(
        model=str(tiny_models["llama"]),
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        num_threads=NUM_THREADS,
    )
    return EngineCore(config)


@pytest.fixture(scope="module")
def hf_model(tiny_models: dict[str, Path]) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32)
    return model.eval()


def scoring(**overrides: object) -> SamplingParams:
    """One greedy token whose position reports the LABELS' logprobs."""
    settings: dict[str, object] = dict(
        temperature=0.0, max_tokens=1, ignore_eos=True, logprob_token_ids=LABELS
    )
    settings.update(overrides)
    return SamplingParams(**settings)  # type: ignore[arg-type]


def requested(lp: Logprobs) -> list[float]:
    assert lp.requested is not None, "no logprob_token_ids values came back"
    return lp.requested


def test_label_logprobs_match_hf_at_the_last_prompt_position(
    engine: EngineCore, hf_model: PreTrainedModel
) -> None:
    prompts = random_prompts(7, 6, TINY_VOCAB_SIZE, 1, 60)
    params = [
        scoring(),
        # The raw distribution: sampling settings change the token, not these values.
        scoring(temperature=0.8, seed=1, repetition_penalty=1.7, logit_bias={LABELS[0]: 30.0}),
        scoring(logprobs=3),  # top-N and requested ids side by side
        scoring(logprob_token_ids=[LABELS[1], LABELS[1]]),  # a repeat answers twice
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),  # asks for nothing
        scoring(presence_penalty=2.0, frequency_penalty=-2.0),
    ]
    cases = list(enumerate(zip(prompts, params, strict=True)))
    run = run_to_completion(engine, [AddRequest(f"s{i}", p, sp, 0.0) for i, (p, sp) in cases])
    for i, (prompt, sp) in cases:
        record = run.records[f"s{i}"]
        assert len(record.token_ids) == 1
        if sp.logprob_token_ids is None:
            assert record.logprobs == []
            continue
        (lp,) = record.logprobs
        expected = hf_logprobs(hf_model, prompt)[-1]  # [vocab]
        got = torch.tensor(requested(lp))
        torch.testing.assert_close(got, expected[sp.logprob_token_ids], atol=ATOL, rtol=0)
        # The chosen token's logprob comes along, from the same distribution.
        assert lp.token_ids[0] == record.token_ids[0]
        assert lp.logprobs[0] == pytest.approx(float(expected[lp.token_ids[0]]), abs=ATOL)
        if sp.logprobs:
            assert lp.token_ids[1:] == expected.topk(sp.logprobs).indices.tolist()


def test_every_sampled_position_reports_the_labels(
    engine: EngineCore, hf_model: PreTrainedModel
) -> None:
    prompt = random_prompts(8, 1, TINY_VOCAB_SIZE, 30, 30)[0]
    run = run_to_completion(engine, [AddRequest("g", prompt, scoring(max_tokens=4), 0.0)])
    record = run.records["g"]
    assert len(record.logprobs) == 4
    full = hf_logprobs(hf_model, prompt + record.token_ids)  # [len, vocab]
    for k, lp in enumerate(record.logprobs):
        expected = full[len(prompt) - 1 + k, LABELS]
        torch.testing.assert_close(torch.tensor(requested(lp)), expected, atol=ATOL, rtol=0)


def test_shared_prefix_blocks_give_the_same_values(
    engine: EngineCore, hf_model: PreTrainedModel
) -> None:
    """Items after one query, all in the same step: the later ones reuse the
    first one's prefix blocks and still read the right distribution."""
    query = random_prompts(9, 1, TINY_VOCAB_SIZE, 40, 40)[0]
    items = random_prompts(10, 4, TINY_VOCAB_SIZE, 1, 9)
    run = run_to_completion(
        engine, [AddRequest(f"p{i}", query + item, scoring(), 0.0) for i, item in enumerate(items)]
    )
    block_size = engine.scheduler.block_manager.block_size
    shared = len(query) // block_size * block_size
    assert [run.records[f"p{i}"].num_cached_tokens for i in range(4)] == [0] + [shared] * 3
    for i, item in enumerate(items):
        expected = hf_logprobs(hf_model, query + item)[-1, LABELS]
        got = torch.tensor(requested(run.records[f"p{i}"].logprobs[0]))
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "1 to"),
        ([-1], "must not be negative"),
        ([TINY_VOCAB_SIZE], f"[0, {TINY_VOCAB_SIZE})"),
        (list(range(MAX_LOGPROB_TOKEN_IDS + 1)), "1 to"),
    ],
)
def test_validation_names_the_field(ids: list[int], message: str) -> None:
    with pytest.raises(SamplingParamsError, match=re.escape(message)) as info:
        SamplingParams(logprob_token_ids=ids).validate(TINY_VOCAB_SIZE)
    assert info.value.param == "logprob_token_ids"


def test_engine_refuses_ids_outside_the_vocabulary(engine: EngineCore) -> None:
    refusal = engine.add_request(
        AddRequest("bad", [1, 2, 3], scoring(logprob_token_ids=[TINY_VOCAB_SIZE + 5]), 0.0)
    )
    assert refusal is not None and refusal.error is not None
    assert "logprob_token_ids" in refusal.error
    assert not engine.has_work()
