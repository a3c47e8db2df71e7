"""Speculative decoding by prompt lookup (--speculative-config, core/spec_decode.py).

The proposer on its own; then engines with and without speculation on a
tiny random-weight Llama: greedy outputs equal token for token (repetitive
and random prompts, continuous batching, preemption, prefix caching, chunked
prefill, stop rules mid-draft), and sampled outputs follow the target
model's distribution (a chi-square test against the probabilities the
engine's own logprobs give).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.block_manager import BlockManager
from pagoda.engine_core.core.engine import CPU_MAX_STEP_TOKENS_WITH_DRAFTS, EngineCore
from pagoda.engine_core.core.request import Request
from pagoda.engine_core.core.spec_decode import (
    MISSES_BEFORE_PAUSE,
    NgramProposer,
    SpeculativeConfig,
    ngram_draft,
    parse_speculative_config,
)
from pagoda.engine_core.model_config import load_model_config
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import (
    NUM_THREADS,
    EngineRun,
    greedy_params,
    kv_bytes_for_blocks,
    random_prompts,
    run_to_completion,
)

SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
)

# ------------------------------------------------------------------ proposer


def test_ngram_draft_follows_the_longest_earliest_match() -> None:
    # vLLM's example: [4, 2, 3] has no earlier match, [2, 3] has; 3 tokens follow it.
    assert ngram_draft([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]
    assert ngram_draft([1, 2, 3, 4, 2, 3], 2, 3, 2) == [4, 2]
    # The longest n-gram wins over a shorter one found earlier.
    assert ngram_draft([7, 3, 9, 1, 2, 3, 5, 1, 2, 3], 1, 3, 2) == [5, 1]
    # Of several occurrences of that n-gram, the earliest.
    assert ngram_draft([1, 2, 8, 1, 2, 9, 1, 2], 2, 2, 1) == [8]
    # A match may overlap the suffix itself.
    assert ngram_draft([5, 5, 5, 5], 2, 2, 3) == [5, 5]
    # No match, too short a context, or n-grams shorter than the minimum.
    assert ngram_draft([1, 2, 3, 4], 1, 3, 4) == []
    assert ngram_draft([1], 1, 1, 4) == []
    assert ngram_draft([1, 2, 3, 1], 2, 3, 4) == []
    assert ngram_draft([1, 2, 3, 1], 1, 3, 4) == [2, 3, 1]
    assert ngram_draft([1, 2, 1], 1, 2, 0) == []
    # Token ids whose bytes match across token boundaries are not matches.
    assert ngram_draft([0x01000000, 0x02, 0x0100, 0x03, 0x0100], 1, 1, 1) == [0x03]
    assert ngram_draft([0x0201, 0x0300, 0x02, 0x03], 2, 2, 1) == []


def test_ngram_draft_matches_a_brute_force_search() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        k = rng.randint(1, 5)
        expected: list[int] = []
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            suffix = tokens[-n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
            if starts:
                expected = tokens[starts[0] + n : starts[0] + n + k]
                break
        assert ngram_draft(tokens, lo, hi, k) == expected, (tokens, lo, hi, k)


def test_proposer_pauses_after_rejections() -> None:
    proposer = NgramProposer(SpeculativeConfig(3, 1, 2))
    tokens = [1, 2, 3, 1, 2]
    assert proposer.propose("r", tokens, 8) == [3, 1, 2]
    assert proposer.propose("r", tokens, 2) == [3, 1]
    for _ in range(MISSES_BEFORE_PAUSE):
        proposer.record("r", 3, 0)
    paused = 0
    while not proposer.propose("r", tokens, 8):
        paused += 1
    assert paused > 0
    proposer.record("r", 3, 1)  # an acceptance resets the count
    for _ in range(MISSES_BEFORE_PAUSE - 1):
        proposer.record("r", 3, 0)
    # Few accepted lately: one draft more than the running mean.
    assert proposer.propose("r", tokens, 8) == [3]
    for _ in range(4):
        proposer.record("r", 3, 3)
    assert proposer.propose("r", tokens, 8) == [3, 1, 2]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "must be an integer"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}', "unknown keys"),
        ('{"model": "/models/draft", "num_speculative_tokens": 3}', "not available yet"),
    ],
)
def test_bad_speculative_config_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(text)
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=text)


def test_speculative_config_defaults() -> None:
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert spec == SpeculativeConfig(3, 5, 5)
    spec = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert spec == SpeculativeConfig(3, 4, 4)


# -------------------------------------------------------------------- engine


def make_engine(tiny_models: dict[str, Path], spec: str | None, **kwargs: object) -> EngineCore:
    settings: dict[str, object] = dict(
        model=str(tiny_models["llama"]),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=256,
        num_threads=NUM_THREADS,
        speculative_config=spec,
    )
    settings.update(kwargs)
    return EngineCore(EngineConfig(**settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def plain(tiny_models: dict[str, Path]) -> EngineCore:
    return make_engine(tiny_models, None)


@pytest.fixture(scope="module")
def spec(tiny_models: dict[str, Path]) -> EngineCore:
    return make_engine(tiny_models, SPEC)


def repetitive_prompts(seed: int, num: int) -> list[list[int]]:
    """A short random phrase said three times, then its first half."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        phrase = [rng.randrange(1, 900) for _ in range(rng.randint(5, 9))]
        prompts.append(phrase * 3 + phrase[: len(phrase) // 2])
    return prompts


def mixed_prompts() -> list[list[int]]:
    return repetitive_prompts(1, 4) + random_prompts(2, 4, 900, 5, 30)


def outputs(
    engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams]
) -> EngineRun:
    pairs = enumerate(zip(prompts, params, strict=True))
    requests = [AddRequest(f"r{i}", p, sp, 0.0) for i, (p, sp) in pairs]
    return run_to_completion(engine, requests)


def tokens_of(run: EngineRun) -> dict[str, list[int]]:
    return {k: r.token_ids for k, r in run.records.items()}


def spec_counts(engine: EngineCore) -> tuple[int, int]:
    s = engine.scheduler.stats()
    return s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens


def test_greedy_output_equals_no_speculation(plain: EngineCore, spec: EngineCore) -> None:
    prompts = mixed_prompts()
    # Continuous batching: requests with penalties or logit bias run without
    # drafts in the same steps as the others; logprobs come with each kept token.
    params = [greedy_params(40) for _ in prompts]
    params[1] = greedy_params(40, logprobs=2)
    params[2] = greedy_params(40, logit_bias={5: 2.0})
    params[6] = greedy_params(40, repetition_penalty=1.3)
    drafts_before, accepted_before = spec_counts(spec)
    expected = outputs(plain, prompts, params)
    run = outputs(spec, prompts, params)
    assert tokens_of(run) == tokens_of(expected)
    drafts, accepted = spec_counts(spec)
    assert accepted - accepted_before > 20, "lookup should help on these prompts"
    stats = spec.scheduler.stats()
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # position j needs j - 1 kept before it
    assert drafts - drafts_before > accepted - accepted_before, "some drafts are rejected"
    # Steps that verified drafts also carried requests without them.
    mixed = [
        p
        for p in run.plans
        if p.spec_token_ids and len(p.spec_token_ids) < len(p.num_scheduled_tokens)
    ]
    assert mixed
    drafted = {r for p in run.plans for r in p.spec_token_ids}
    assert "r1" in drafted and "r2" not in drafted and "r6" not in drafted
    assert len(run.records["r1"].logprobs) == 40
    # (Other rows in the batch change the last bits of a row's logits.)
    for got, want in zip(run.records["r1"].logprobs, expected.records["r1"].logprobs, strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_blocks_holding_drafts_are_not_cached() -> None:
    """allocate_slots for a token and its drafts caches full blocks only up to
    the request's real tokens; the next step caches what was kept."""
    manager = BlockManager(8, 4, enable_prefix_caching=True)
    request = Request("r", list(range(7)), SamplingParams(), [], 0.0)
    assert manager.allocate_slots(request, 6, [])  # the prompt, then one token
    request.num_computed_tokens = 6
    # The 7th token and 4 drafts: positions 6..10 (blocks 1 and 2 filled).
    assert manager.allocate_slots(request, 5)
    assert len(manager.cached_blocks) == 1  # block 1 holds position 7: a draft
    # Two drafts kept, then the model's token: 10 real tokens, 9 computed.
    for token_id in (7, 8, 9):
        request.append_output_token(token_id)
    request.num_computed_tokens = 9
    assert manager.allocate_slots(request, 1)
    assert len(manager.cached_blocks) == 2  # block 1 is real tokens now; block 2 is not full
    manager.check_invariants()


def test_drafts_stop_where_a_step_would_pass_the_cap(plain: EngineCore, spec: EngineCore) -> None:
    """On the CPU a step's decoding requests and drafts stay within
    CPU_MAX_STEP_TOKENS_WITH_DRAFTS; 40 decoding requests get no drafts at all."""
    assert spec.scheduler.max_step_tokens_with_drafts == CPU_MAX_STEP_TOKENS_WITH_DRAFTS
    prompts = repetitive_prompts(9, 40)
    params = [greedy_params(12) for _ in prompts]
    run = outputs(spec, prompts, params)
    assert tokens_of(run) == tokens_of(outputs(plain, prompts, params))
    for plan in run.plans:
        decoding = sum(1 for r, n in plan.num_scheduled_tokens.items() if n == 1)
        decoding += len(plan.spec_token_ids)
        drafts = sum(len(d) for d in plan.spec_token_ids.values())
        assert not drafts or decoding + drafts <= CPU_MAX_STEP_TOKENS_WITH_DRAFTS
    assert not any(len(p.num_scheduled_tokens) == 40 and p.spec_token_ids for p in run.plans)
    few = outputs(spec, prompts[:4], params[:4])
    assert any(p.spec_token_ids for p in few.plans)


def test_prefix_cache_after_speculation_holds_only_real_tokens(
    plain: EngineCore, spec: EngineCore
) -> None:
    """Blocks filled while drafts were verified are found again by a prompt that
    extends the first request's prompt and output; its output must not change."""
    prompts = repetitive_prompts(3, 2)
    params = [greedy_params(60), greedy_params(60)]
    first = outputs(spec, prompts, params)
    assert tokens_of(first) == tokens_of(outputs(plain, prompts, params))
    longer = [p + first.records[f"r{i}"].token_ids[:50] for i, p in enumerate(prompts)]
    hits_before = spec.scheduler.block_manager.num_prefix_hits
    run = outputs(spec, longer, [greedy_params(30), greedy_params(30)])
    assert spec.scheduler.block_manager.num_prefix_hits - hits_before >= 2 * 48
    assert tokens_of(run) == tokens_of(outputs(plain, longer, [greedy_params(30)] * 2))


def test_preemption_and_chunked_prefill(tiny_models: dict[str, Path], plain: EngineCore) -> None:
    mc = load_model_config(str(tiny_models["llama"]))
    small = make_engine(
        tiny_models,
        SPEC,
        kv_cache_memory_bytes=kv_bytes_for_blocks(mc, 24, 16),
        max_num_batched_tokens=24,
        max_model_len=128,
    )
    prompts = repetitive_prompts(4, 4) + random_prompts(5, 2, 900, 20, 40)
    params = [greedy_params(50) for _ in prompts]
    run = outputs(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert any(
        n > 1 and r not in p.spec_token_ids
        for p in run.plans
        for r, n in p.num_scheduled_tokens.items()
    )
    assert small.scheduler.stats().spec_decode_num_accepted_tokens > 0
    assert tokens_of(run) == tokens_of(outputs(plain, prompts, params))


def test_stop_rules_mid_draft(plain: EngineCore, spec: EngineCore) -> None:
    prompt = repetitive_prompts(6, 1)[0]
    base = outputs(plain, [prompt], [greedy_params(40)]).records["r0"].token_ids
    cases = [greedy_params(n) for n in range(1, 12)]  # max_tokens at every point of a draft
    for stop in dict.fromkeys(base[2:12]):
        cases.append(SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop]))
        cases.append(
            SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], min_tokens=9)
        )
    prompts = [prompt] * len(cases)
    run = outputs(spec, prompts, cases)
    expected = outputs(plain, prompts, cases)
    assert tokens_of(run) == tokens_of(expected)
    for key, record in run.records.items():
        assert record.finish_reason == expected.records[key].finish_reason


def test_eos_mid_draft(plain: EngineCore, spec: EngineCore) -> None:
    """EOS set to a token the greedy output repeats: both engines stop at its
    first appearance (after min_tokens), and ignore_eos runs past it."""
    prompt = repetitive_prompts(6, 1)[0]
    base = outputs(plain, [prompt], [greedy_params(40)]).records["r0"].token_ids
    eos = base[7]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    ]
    runs = []
    for engine in (plain, spec):
        info = engine.info
        engine.info = dataclasses.replace(info, eos_token_ids=(eos,))
        try:
            runs.append(outputs(engine, [prompt] * len(cases), cases))
        finally:
            engine.info = info
    assert tokens_of(runs[1]) == tokens_of(runs[0])
    assert runs[1].records["r0"].token_ids == base[: base.index(eos) + 1]
    assert runs[1].records["r0"].finish_reason == "stop"
    assert runs[1].records["r2"].token_ids == base


# --------------------------------------------------------------- sampling


TEMPERATURE = 0.7


def _filtered(logprobs: list[tuple[int, float]]) -> dict[int, float]:
    """top_k=3 at TEMPERATURE: the top three raw logprobs, scaled and renormalised."""
    top = sorted(logprobs, key=lambda t: -t[1])[:3]
    weights = torch.tensor([lp for _, lp in top], dtype=torch.float64) / TEMPERATURE
    probs = torch.softmax(weights, dim=0).tolist()
    return {t: p for (t, _), p in zip(top, probs, strict=True)}


def _next_probs(engine: EngineCore, contexts: list[list[int]]) -> list[dict[int, float]]:
    params = [SamplingParams(temperature=0.0, max_tokens=1, logprobs=3) for _ in contexts]
    run = outputs(engine, contexts, params)
    found = []
    for i in range(len(contexts)):
        lp = run.records[f"r{i}"].logprobs[0]
        pairs = list(zip(lp.token_ids[1:], lp.logprobs[1:], strict=True))
        found.append(_filtered(pairs))
    return found


def test_sampled_output_follows_the_target_distribution(
    plain: EngineCore, spec: EngineCore
) -> None:
    """The first three tokens of 3000 seeded requests (top_k 3, so 27 outcomes),
    with a draft verified at the second and the third sampled after it,
    against the exact joint probabilities from the engine's logprobs.
    Chi-square over the cells with an expected count of at least 5 (the rest
    pooled): the seeds are fixed, so the test is deterministic; a correct
    sampler fails it for 0.1% of seed sets, while keeping drafts too often or
    too rarely by a few percent of probability moves whole cells far past
    the threshold."""
    # A prompt where lookup proposes what the model itself tends to say next:
    # its own greedy continuation, long enough to repeat itself.
    start = random_prompts(8, 1, 900, 6, 6)[0]
    prompt = start + outputs(plain, [start], [greedy_params(120)]).records["r0"].token_ids
    p1 = _next_probs(plain, [prompt])[0]
    firsts = list(p1)
    p2 = dict(zip(firsts, _next_probs(plain, [prompt + [a] for a in firsts]), strict=True))
    pairs = [(a, b) for a in firsts for b in p2[a]]
    p3 = dict(zip(pairs, _next_probs(plain, [prompt + [a, b] for a, b in pairs]), strict=True))
    expected = {(a, b, c): p1[a] * p2[a][b] * p3[(a, b)][c] for a, b in pairs for c in p3[(a, b)]}
    num = 3000
    # Drafts at every step, whatever the batch (the CPU's cap would stop them).
    params = [
        SamplingParams(temperature=TEMPERATURE, top_k=3, max_tokens=3, seed=i) for i in range(num)
    ]
    scheduler = spec.scheduler
    cap, scheduler.max_step_tokens_with_drafts = scheduler.max_step_tokens_with_drafts, None
    drafts_before, accepted_before = spec_counts(spec)
    try:
        run = outputs(spec, [prompt] * num, params)
        # Seeded requests are reproducible: the same seeds give the same tokens.
        again = outputs(spec, [prompt] * 20, params[:20])
    finally:
        scheduler.max_step_tokens_with_drafts = cap
    drafts, accepted = spec_counts(spec)
    num_drafts, num_accepted = drafts - drafts_before, accepted - accepted_before
    assert num_accepted > num // 10, "drafts must be kept often"
    assert num_drafts - num_accepted > num // 10, "and rejected often"
    counts: dict[tuple[int, ...], int] = {}
    for record in run.records.values():
        key = tuple(record.token_ids)
        assert key in expected, f"{key} is outside the top-3 support"
        counts[key] = counts.get(key, 0) + 1
    big = [k for k, p in expected.items() if p * num >= 5]
    rest = 1.0 - sum(expected[k] for k in big)
    observed = [counts.get(k, 0) for k in big] + [num - sum(counts.get(k, 0) for k in big)]
    means = [expected[k] * num for k in big] + [rest * num]
    cells = [(o, m) for o, m in zip(observed, means, strict=True) if m > 0]
    chi2 = sum((o - m) ** 2 / m for o, m in cells)
    dof = len(cells) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)).item()
    assert p_value > 1e-3, (chi2, dof, p_value)
    assert all(again.records[k].token_ids == run.records[k].token_ids for k in again.records)
