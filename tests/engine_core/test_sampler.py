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

import pagoda.kernels.sampling
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.worker.model_runner import ModelRunner
from pagoda.engine_core.worker.sampler import SamplingRow, sample
from pagoda.engine_core.worker.token_history import TokenHistory
from pagoda.kernels.cpu_ops import load_cpu_ops
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams, SamplingParamsError
from tests.engine_core.helpers import (
    NUM_THREADS,
    kv_bytes_for_blocks,
    random_prompts,
    run_to_completion,
)
from tests.statistics import chi_square_p


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
    # Token history rows belong to penalized requests the runner still holds
    # (it hears of the last finished ones with the next plan): none leak.
    for core in (engine, small):
        runner = core.executor.worker.runner
        assert isinstance(runner, ModelRunner)
        held = [s.history_slot for s in runner.requests.values() if s.history_slot >= 0]
        assert runner.history.num_used == len(held) == len(set(held))

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
NUM_DRAWS = 20_000


@pytest.fixture(params=["compiled", "torch"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The compiled sampling kernels, or their plain-torch references."""
    if request.param == "compiled" and load_cpu_ops() is None:
        pytest.skip("no compiled CPU kernels")
    if request.param == "torch":
        monkeypatch.setattr(pagoda.kernels.sampling, "load_cpu_ops", lambda: None)
    return str(request.param)


def draw(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int] | None = None,
    output_ids: list[int] | None = None,
    num_draws: int = NUM_DRAWS,
) -> torch.Tensor:
    """num_draws samples of one distribution → counts per token [vocab]."""
    history = TokenHistory()
    prompt, output = prompt_ids or [], output_ids or []
    slot = history.add(prompt + output, len(prompt))
    row = SamplingRow(params, output, eos_token_ids=(), history_slot=slot)
    batch = logits.expand(num_draws, logits.shape[0]).clone()  # [num_draws, vocab]
    token_ids, _ = sample(batch, [row] * num_draws, history)
    return torch.bincount(torch.tensor(token_ids), minlength=logits.shape[0])


def hf_probs(
    logits: torch.Tensor, warpers: list[object], input_ids: list[int] | None = None
) -> torch.Tensor:
    scores = logits[None, :].clone()
    ids = torch.tensor([input_ids or [0]])
    for warper in warpers:
        scores = warper(ids, scores)  # type: ignore[operator]
    return torch.softmax(scores[0].double(), dim=-1)


def assert_follows(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Nothing outside the expected support, and frequencies that a
    chi-square test does not reject (the draws are seeded: no flakes)."""
    assert int(counts[expected == 0].sum()) == 0, "drew a token the filters remove"
    p_value = chi_square_p(counts, expected)
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}"


# (vocab, params, transformers' warpers for the same setting)
WARPER_CASES = [
    (VOCAB, SamplingParams(), []),  # the defaults: temperature 1, no filter
    (VOCAB, SamplingParams(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
    (
        VOCAB,
        SamplingParams(temperature=0.8, top_p=0.95),
        [TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.95)],
    ),
    (VOCAB, SamplingParams(top_k=5), [TopKLogitsWarper(5)]),
    (300, SamplingParams(top_k=50), [TopKLogitsWarper(50)]),
    (VOCAB, SamplingParams(top_p=0.6), [TopPLogitsWarper(0.6)]),
    (VOCAB, SamplingParams(min_p=0.2), [MinPLogitsWarper(0.2)]),
    (300, SamplingParams(min_p=0.05), [MinPLogitsWarper(0.05)]),
    (
        VOCAB,
        SamplingParams(temperature=1.4, top_k=10, top_p=0.8, min_p=0.1),
        [
            TemperatureLogitsWarper(1.4),
            TopKLogitsWarper(10),
            TopPLogitsWarper(0.8),
            MinPLogitsWarper(0.1),
        ],
    ),
    (
        1000,
        SamplingParams(temperature=0.9, top_p=0.7, min_p=0.01),
        [TemperatureLogitsWarper(0.9), TopPLogitsWarper(0.7), MinPLogitsWarper(0.01)],
    ),
]


@pytest.mark.parametrize(
    ("vocab", "params", "warpers"),
    WARPER_CASES,
    ids=[
        "defaults",
        "temperature",
        "t0.8-top_p0.95",
        "top_k5",
        "top_k50",
        "top_p",
        "min_p",
        "min_p0.05",
        "combined",
        "top_p-min_p-1000",
    ],
)
def test_sampling_distribution_matches_hf_warpers(
    kernel_path: str, vocab: int, params: SamplingParams, warpers: list[object]
) -> None:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 2.0
    torch.manual_seed(1)  # unseeded rows are keyed from the global generator
    assert_follows(draw(logits, params), hf_probs(logits, warpers))


def test_penalties_match_hf_and_openai(kernel_path: str) -> None:
    """Repetition penalty as transformers' processor (prompt and output
    tokens), then frequency and presence as OpenAI defines them (output
    tokens: logit - count * frequency - (count > 0) * presence)."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 2.0
    likely = logits.topk(6).indices.tolist()
    prompt, output = likely[:3], [likely[3], likely[3], likely[4], likely[0]]
    params = SamplingParams(repetition_penalty=1.8, frequency_penalty=0.4, presence_penalty=0.3)
    torch.manual_seed(3)
    counts = draw(logits, params, prompt_ids=prompt, output_ids=output)
    scores = RepetitionPenaltyLogitsProcessor(1.8)(
        torch.tensor([prompt + output]), logits[None, :].clone()
    )[0]
    occurrences = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    scores = scores - 0.4 * occurrences - 0.3 * (occurrences > 0).float()
    assert_follows(counts, torch.softmax(scores.double(), dim=-1))


def test_seeded_rows_follow_the_distribution(kernel_path: str) -> None:
    """Rows of distinct seeds are independent draws of the same distribution."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(6)) * 2.0
    rows = [
        SamplingRow(SamplingParams(temperature=0.9, top_p=0.9, seed=s), [], ())
        for s in range(NUM_DRAWS)
    ]
    token_ids, _ = sample(logits.expand(NUM_DRAWS, VOCAB).clone(), rows)
    counts = torch.bincount(torch.tensor(token_ids), minlength=VOCAB)
    expected = hf_probs(logits, [TemperatureLogitsWarper(0.9), TopPLogitsWarper(0.9)])
    assert_follows(counts, expected)


def test_a_mixed_batch_samples_each_row_by_its_own_settings(kernel_path: str) -> None:
    """Greedy, default, top-k, top-p, min-p, penalized and seeded rows in one batch."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(8)) * 2.0
    history = TokenHistory()
    seen = logits.topk(2).indices.tolist()
    slot = history.add(seen, len(seen))
    kinds: list[tuple[SamplingParams, list[object], int]] = [
        (SamplingParams(temperature=0.0), [], -1),
        (SamplingParams(), [], -1),
        (SamplingParams(top_k=4), [TopKLogitsWarper(4)], -1),
        (
            SamplingParams(temperature=0.8, top_p=0.7),
            [TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.7)],
            -1,
        ),
        (SamplingParams(min_p=0.3), [MinPLogitsWarper(0.3)], -1),
        (SamplingParams(repetition_penalty=1.5), [RepetitionPenaltyLogitsProcessor(1.5)], slot),
    ]
    per_kind = 6000
    rows = [
        SamplingRow(params, [], (), history_slot=hs) for params, _, hs in kinds
    ] * per_kind  # interleaved: row i is kind i % len(kinds)
    torch.manual_seed(9)
    token_ids, _ = sample(logits.expand(len(rows), VOCAB).clone(), rows, history)
    tokens = torch.tensor(token_ids).view(per_kind, len(kinds))
    assert bool((tokens[:, 0] == logits.argmax()).all())
    for j, (_, warpers, _) in enumerate(kinds[1:], start=1):
        counts = torch.bincount(tokens[:, j], minlength=VOCAB)
        assert_follows(counts, hf_probs(logits, warpers, input_ids=seen))


def test_token_history_grows_and_reuses_rows() -> None:
    history = TokenHistory(num_rows=2, width=4)
    a = history.add([5, 6, 7], 2)
    b = history.add([1], 1)
    c = history.add(list(range(10)), 10)  # a third row and a wider one
    for t in range(6):
        history.append(a, 100 + t)
    assert history.token_ids(a) == [5, 6, 7, 100, 101, 102, 103, 104, 105]
    assert history.token_ids(b) == [1] and history.token_ids(c) == list(range(10))
    assert history.prompt_lens[a] == 2 and history.num_used == 3
    history.release(b)
    assert history.add([9, 9], 2) == b and history.token_ids(b) == [9, 9]
    ids = history.tensor()
    assert ids.dtype == torch.int32 and ids[a, :9].tolist() == history.token_ids(a)
    history.clear()
    assert history.num_used == 0


def test_logit_bias_and_seeded_rows() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    biased = SamplingRow(SamplingParams(temperature=0.0, logit_bias={7: 100.0}), [], ())
    token_ids, _ = sample(logits, [biased, biased])
    assert token_ids == [7, 7]

    def seeded_row(seed: int) -> SamplingRow:
        return SamplingRow(SamplingParams(temperature=1.0, seed=seed), [], ())

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
