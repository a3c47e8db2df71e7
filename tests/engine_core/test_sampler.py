"""Sampling: batch-independent seeds, top-k/top-p/min-p and penalties vs HF, validation.

Seeded sampling runs through EngineCore with a tiny random-weight model; the
filters are compared with transformers' own logits warpers on random logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.sampler import SamplingRow, sample
from protocol.messages import AddRequest
from protocol.sampling_params import SamplingParams, SamplingParamsError
from tests.engine_core.helpers import (
    NUM_THREADS,
    kv_bytes_for_blocks,
    random_prompts,
    run_to_completion,
)


def tiny_engine(model: Path, **overrides: object) -> EngineCore:
    settings: dict[str, object] = dict(
        model=str(model),
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        num_threads=NUM_THREADS,
    )
    settings.update(overrides)
    return EngineCore(EngineConfig(**settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> EngineCore:
    return tiny_engine(tiny_models["llama"])


def seeded(seed: int, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_p=0.95, top_k=200, seed=seed, max_tokens=max_tokens, ignore_eos=True
    )


def companions(vocab_size: int) -> list[AddRequest]:
    """Requests of every kind to share the batch with the seeded one."""
    prompts = random_prompts(5, 6, vocab_size, 1, 50)
    params = [
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        seeded(7, max_tokens=40),
        SamplingParams(temperature=1.3, top_k=5, min_p=0.05, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0.7,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            max_tokens=28,
            ignore_eos=True,
        ),
        SamplingParams(temperature=1.0, logprobs=3, seed=99, max_tokens=12, ignore_eos=True),
    ]
    return [
        AddRequest(f"c{i}", p, sp, 0.0)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]


@pytest.mark.slow
def test_seeded_sampling_does_not_depend_on_the_batch(
    engine: EngineCore, tiny_models: dict[str, Path]
) -> None:
    vocab = engine.info.vocab_size
    prompt = random_prompts(3, 1, vocab, 30, 30)[0]
    alone = run_to_completion(engine, [AddRequest("x", prompt, seeded(1234), 0.0)])
    tokens = alone.records["x"].token_ids
    assert len(tokens) == 24

    batched = run_to_completion(
        engine, [*companions(vocab), AddRequest("x", prompt, seeded(1234), 0.0)]
    )
    assert batched.records["x"].token_ids == tokens

    # Preempted and resumed, the request continues its own random stream.
    small = tiny_engine(
        tiny_models["llama"],
        kv_cache_memory_bytes=kv_bytes_for_blocks(engine.model_config, 6, 16),
        max_num_batched_tokens=32,
    )
    # Arriving last, it is the first to be preempted.
    requests = [*companions(vocab), AddRequest("x", prompt, seeded(1234), 1.0)]
    squeezed = run_to_completion(small, requests)
    num_starts = sum(n.request_id == "x" for plan in squeezed.plans for n in plan.new_requests)
    assert num_starts > 1, "x was never preempted"
    assert squeezed.records["x"].token_ids == tokens

    # And the seed matters: other seeds draw other tokens.
    others = run_to_completion(
        engine, [AddRequest(f"s{s}", prompt, seeded(s), 0.0) for s in (1, 2, 3)]
    )
    assert any(others.records[f"s{s}"].token_ids != tokens for s in (1, 2, 3))


@pytest.mark.slow
def test_top_k_1_equals_greedy(engine: EngineCore) -> None:
    prompts = random_prompts(11, 4, engine.info.vocab_size, 1, 40)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True)
    run = run_to_completion(
        engine,
        [AddRequest(f"g{i}", p, greedy, 0.0) for i, p in enumerate(prompts)]
        + [AddRequest(f"k{i}", p, top1, 0.0) for i, p in enumerate(prompts)],
    )
    for i in range(len(prompts)):
        assert run.records[f"k{i}"].token_ids == run.records[f"g{i}"].token_ids


# ---------------------------------------------------------------------------
# the sampler on random logits, against transformers' warpers
# ---------------------------------------------------------------------------

VOCAB = 24
NUM_DRAWS = 4000


def draw(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int] | None = None
) -> torch.Tensor:
    """NUM_DRAWS samples of one distribution → counts per token [VOCAB]."""
    row = SamplingRow(params, None, prompt_ids or [], [], eos_token_ids=())
    batch = logits.expand(NUM_DRAWS, VOCAB).clone()  # [NUM_DRAWS, VOCAB]
    token_ids, _ = sample(batch, [row] * NUM_DRAWS)
    return torch.bincount(torch.tensor(token_ids), minlength=VOCAB)


def hf_probs(logits: torch.Tensor, warpers: list[object]) -> torch.Tensor:
    scores = logits[None, :].clone()
    input_ids = torch.zeros((1, 1), dtype=torch.long)
    for warper in warpers:
        scores = warper(input_ids, scores)  # type: ignore[operator]
    return torch.softmax(scores[0], dim=-1)


@pytest.mark.parametrize(
    ("params", "warpers"),
    [
        (SamplingParams(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
        (SamplingParams(top_k=5), [TopKLogitsWarper(5)]),
        (SamplingParams(top_p=0.6), [TopPLogitsWarper(0.6)]),
        (SamplingParams(min_p=0.2), [MinPLogitsWarper(0.2)]),
        (
            SamplingParams(temperature=1.4, top_k=10, top_p=0.8, min_p=0.1),
            [
                TemperatureLogitsWarper(1.4),
                TopKLogitsWarper(10),
                TopPLogitsWarper(0.8),
                MinPLogitsWarper(0.1),
            ],
        ),
    ],
    ids=["temperature", "top_k", "top_p", "min_p", "combined"],
)
def test_sampling_distribution_matches_hf_warpers(
    params: SamplingParams, warpers: list[object]
) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=generator) * 2.0
    torch.manual_seed(1)  # unseeded rows draw from the global generator
    counts = draw(logits, params)
    expected = hf_probs(logits, warpers)
    # Nothing outside HF's support, and frequencies within ~5 standard errors.
    assert counts[expected == 0].sum() == 0
    torch.testing.assert_close(counts / NUM_DRAWS, expected, atol=0.04, rtol=0)


def test_repetition_penalty_matches_hf() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(VOCAB, generator=generator) * 2.0
    seen = logits.topk(4).indices.tolist()  # penalize the likeliest tokens
    params = SamplingParams(temperature=1.0, repetition_penalty=1.8)
    torch.manual_seed(3)
    counts = draw(logits, params, prompt_ids=seen)
    processor = RepetitionPenaltyLogitsProcessor(1.8)
    scores = processor(torch.tensor([seen]), logits[None, :].clone())
    torch.testing.assert_close(counts / NUM_DRAWS, torch.softmax(scores[0], -1), atol=0.04, rtol=0)


def test_logit_bias_and_seeded_rows() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    biased = SamplingRow(SamplingParams(temperature=0.0, logit_bias={7: 100.0}), None, [], [], ())
    token_ids, _ = sample(logits, [biased, biased])
    assert token_ids == [7, 7]

    def seeded_row(seed: int) -> SamplingRow:
        g = torch.Generator().manual_seed(seed)
        return SamplingRow(SamplingParams(temperature=1.0, seed=seed), g, [], [], ())

    first, _ = sample(logits, [seeded_row(5), seeded_row(6)])
    # Row order and neighbours do not change a seeded row's draw.
    second, _ = sample(logits.flip(0), [seeded_row(6), seeded_row(5)])
    assert first == second[::-1]


# ---------------------------------------------------------------------------
# validation at the edge
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -1.0),
        ("temperature", 101.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("seed", 2**64),
        ("stop", [""]),
        ("logit_bias", {3: 101.0}),
    ],
)
def test_validate_names_the_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field) as info:
        params.validate()
    assert isinstance(info.value, SamplingParamsError)
    assert info.value.param == field


def test_validate_with_vocab_size() -> None:
    SamplingParams(stop_token_ids=[5], logit_bias={9: 1.0}).validate(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).validate(vocab_size=10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).validate(vocab_size=10)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4).validate()


def test_valid_defaults_pass() -> None:
    SamplingParams().validate()
    SamplingParams(top_k=-1, temperature=0.0, logprobs=20, prompt_logprobs=0).validate()
