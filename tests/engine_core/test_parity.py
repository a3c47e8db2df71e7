"""Greedy parity with HF transformers, token for token, in float32.

Each case is a checkpoint the engine loads and transformers loads on its
own: tiny random-weight Llama (plain and with llama3 rope scaling), Qwen2
(q/k/v bias) and Qwen3 (q/k norm, tied embeddings) directories, and the
default model's GGUF file. For each: one prompt, a batch of mixed lengths
with logprobs, a tiny KV budget that forces chunked prefill and preemption,
and prefix caching.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from pagoda.engine_core.attention.cpu_backend import COMPILED_PROMPT_MAX_LEN
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.protocol.messages import AddRequest, Logprobs
from tests.conftest import TINY_MODEL_KINDS
from tests.engine_core.helpers import (
    NUM_THREADS,
    EngineRun,
    greedy_params,
    kv_bytes_for_blocks,
    random_prompts,
    run_to_completion,
)
from tests.engine_core.hf_reference import hf_greedy, hf_logprobs

pytestmark = pytest.mark.slow

CASES = (*TINY_MODEL_KINDS, "default_gguf")
NUM_LOGPROBS = 5
NUM_PROMPT_LOGPROBS = 3
LOGPROB_ATOL = 1e-4
BLOCK_SIZE = 16


@dataclass
class ParityCase:
    """A checkpoint, its HF twin, an engine over it, and memoized HF references."""

    name: str
    model: str | None  # the engine's `model` argument
    hf_model: PreTrainedModel
    engine: EngineCore
    vocab_size: int
    max_new_tokens: int
    batch_prompts: list[list[int]]
    single_prompt: list[int]
    hf_batch_size: int  # 1: every reference prompt alone, unpadded
    # The tiny-KV run: the first prompts of the batch, fewer new tokens, few blocks.
    tiny_kv_num_prompts: int
    tiny_kv_max_tokens: int
    tiny_kv_num_blocks: int
    _references: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def references(self, prompts: list[list[int]]) -> list[list[int]]:
        """HF greedy continuations of `prompts`, computed once per prompt."""
        missing = [p for p in prompts if tuple(p) not in self._references]
        if missing:
            outputs = hf_greedy(self.hf_model, missing, self.max_new_tokens, self.hf_batch_size)
            for prompt, output in zip(missing, outputs, strict=True):
                self._references[tuple(prompt)] = output
        return [self._references[tuple(p)] for p in prompts]

    def engine_config(self, **overrides: object) -> EngineConfig:
        return engine_config(self.model, **overrides)


def engine_config(model: str | None, **overrides: object) -> EngineConfig:
    """float32, blocks of 16, 2,048 tokens a step and a modest KV budget unless overridden."""
    settings: dict[str, object] = dict(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=64 << 20,
        # A fixed step budget (the default depends on the device), so that the
        # steps these tests look into are the same everywhere.
        max_num_batched_tokens=2048,
        num_threads=NUM_THREADS,
    )
    settings.update(overrides)
    return EngineConfig(**settings)  # type: ignore[arg-type]


@pytest.fixture(scope="session", params=CASES)
def case(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> ParityCase:
    torch.set_num_threads(NUM_THREADS)
    name: str = request.param
    if name == "default_gguf":
        # Looked up here, so that only this case skips when the package is missing.
        default_model_file: Path = request.getfixturevalue("default_model_file")
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(default_model_file.parent), gguf_file=default_model_file.name, dtype=torch.float32
        )
        model = None
        # The 135M model costs ~0.1 s a step here: a padded HF batch, fewer
        # new tokens, a smaller tiny-KV run. Logprobs are still checked unpadded.
        max_new_tokens, num_prompts, max_len, hf_batch_size = 16, 16, 60, 16
        tiny_kv = (8, 8, 6)
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_models[name]), dtype=torch.float32)
        model = str(tiny_models[name])
        max_new_tokens, num_prompts, max_len, hf_batch_size = 24, 20, 70, 1
        tiny_kv = (num_prompts, max_new_tokens, 8)
    hf_model.eval()
    # Generate exactly max_new_tokens, as the engine does with ignore_eos: an
    # EOS left in the model's generation config would end HF's run early.
    hf_model.generation_config.eos_token_id = None
    vocab_size = hf_model.config.vocab_size
    engine = EngineCore(engine_config(model))
    if name == "default_gguf":
        tokenizer = PreTrainedTokenizerFast.from_pretrained(engine.info.tokenizer_path)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        single_prompt = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    else:
        single_prompt = random_prompts(1, 1, vocab_size, 20, 20)[0]
    return ParityCase(
        name=name,
        model=model,
        hf_model=hf_model,
        engine=engine,
        vocab_size=vocab_size,
        max_new_tokens=max_new_tokens,
        batch_prompts=random_prompts(0, num_prompts, vocab_size, 1, max_len),
        single_prompt=single_prompt,
        hf_batch_size=hf_batch_size,
        tiny_kv_num_prompts=tiny_kv[0],
        tiny_kv_max_tokens=tiny_kv[1],
        tiny_kv_num_blocks=tiny_kv[2],
    )


def batch_requests(prompts: list[list[int]], max_tokens: int) -> list[AddRequest]:
    """Every prompt with logprobs; every other one with prompt logprobs too.

    All arrive at the same time, as an offline batch does.
    """
    return [
        AddRequest(
            f"b{i}",
            prompt,
            greedy_params(
                max_tokens,
                logprobs=NUM_LOGPROBS,
                prompt_logprobs=NUM_PROMPT_LOGPROBS if i % 2 else None,
            ),
            arrival_time=0.0,
        )
        for i, prompt in enumerate(prompts)
    ]


@pytest.fixture(scope="session")
def batch_run(case: ParityCase) -> EngineRun:
    return run_to_completion(case.engine, batch_requests(case.batch_prompts, case.max_new_tokens))


# ---------------------------------------------------------------------------
# greedy tokens
# ---------------------------------------------------------------------------


def test_single_prompt_matches_hf(case: ParityCase) -> None:
    run = run_to_completion(
        case.engine,
        [AddRequest("single", case.single_prompt, greedy_params(case.max_new_tokens), 0.0)],
    )
    (expected,) = case.references([case.single_prompt])
    assert run.records["single"].token_ids == expected
    assert run.records["single"].finish_reason == "length"


def test_batch_matches_hf(case: ParityCase, batch_run: EngineRun) -> None:
    expected = case.references(case.batch_prompts)
    for i, tokens in enumerate(expected):
        assert batch_run.records[f"b{i}"].token_ids == tokens, f"prompt {i}"
    # The batch really was batched: some step decoded several requests at once.
    assert max(len(plan.num_scheduled_tokens) for plan in batch_run.plans) > 1


def test_long_and_short_prompts_in_one_step(case: ParityCase) -> None:
    """Prompts past COMPILED_PROMPT_MAX_LEN (per-sequence SDPA where the
    compiled kernel has no AVX512-BF16 form) between short ones (the compiled
    kernel), all in the same steps."""
    if case.name != "default_gguf":
        pytest.skip("the compiled kernels take head_dim 64, not the tiny models' 16")
    lengths = [12, COMPILED_PROMPT_MAX_LEN + 40, 30, COMPILED_PROMPT_MAX_LEN + 1, 7]
    prompts = [random_prompts(40 + i, 1, case.vocab_size, n, n)[0] for i, n in enumerate(lengths)]
    max_tokens = 6
    run = run_to_completion(
        case.engine,
        [AddRequest(f"m{i}", p, greedy_params(max_tokens), 0.0) for i, p in enumerate(prompts)],
    )
    first = run.plans[0].num_scheduled_tokens
    assert len(first) == len(prompts), "the prompts were not prefilled in one step"
    expected = case.references(prompts)
    for i, tokens in enumerate(expected):
        assert run.records[f"m{i}"].token_ids == tokens[:max_tokens], f"prompt {i}"


def test_tiny_kv_budget_chunks_and_preempts(case: ParityCase, batch_run: EngineRun) -> None:
    """A few blocks of 16 and 32 tokens a step: prompts are chunked, requests preempted."""
    max_num_batched_tokens = 32
    num_blocks = case.tiny_kv_num_blocks
    kv_bytes = kv_bytes_for_blocks(case.engine.model_config, num_blocks, BLOCK_SIZE)
    engine = EngineCore(
        case.engine_config(
            kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=max_num_batched_tokens
        )
    )
    assert engine.info.num_kv_blocks == num_blocks
    prompts = case.batch_prompts[: case.tiny_kv_num_prompts]
    max_tokens = case.tiny_kv_max_tokens
    run = run_to_completion(engine, batch_requests(prompts, max_tokens))

    assert engine.scheduler.num_preemptions > 0
    assert max(plan.total_num_scheduled_tokens for plan in run.plans) <= max_num_batched_tokens
    assert any(
        1 < plan.num_scheduled_tokens[new.request_id] < len(new.token_ids)
        for plan in run.plans
        for new in plan.new_requests
    ), "no prompt was chunked"
    # Greedy continuations of fewer tokens are prefixes of the longer ones.
    expected = case.references(prompts)
    for i, tokens in enumerate(expected):
        record = run.records[f"b{i}"]
        assert record.token_ids == tokens[:max_tokens], f"prompt {i}"
        # Same logprobs as the unconstrained run (which is checked against HF).
        reference = batch_run.records[f"b{i}"]
        assert_logprobs_close(record.logprobs, reference.logprobs[:max_tokens])
        if reference.prompt_logprobs is not None:
            assert record.prompt_logprobs is not None
            assert_logprobs_close(record.prompt_logprobs, reference.prompt_logprobs)


# ---------------------------------------------------------------------------
# logprobs
# ---------------------------------------------------------------------------


def assert_logprobs_close(
    actual: list[Logprobs] | list[Logprobs | None], expected: list[Logprobs] | list[Logprobs | None]
) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        if a is None or e is None:
            assert a is None and e is None
            continue
        assert a.token_ids[0] == e.token_ids[0]
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(e.logprobs), atol=LOGPROB_ATOL, rtol=0
        )


def assert_position_matches(
    entry: Logprobs, hf_row: torch.Tensor, token_id: int, num_top: int
) -> None:
    """One engine Logprobs against HF's log_softmax row for the same position."""
    assert entry.token_ids[0] == token_id
    assert len(entry.token_ids) == len(entry.logprobs) == 1 + num_top
    assert abs(entry.logprobs[0] - float(hf_row[token_id])) < LOGPROB_ATOL
    # The top-N: descending HF values, and HF agrees on each returned id's logprob
    # (checking ids this way is robust to ties in the ordering).
    top = hf_row.topk(num_top).values
    torch.testing.assert_close(torch.tensor(entry.logprobs[1:]), top, atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(
        torch.tensor(entry.logprobs[1:]), hf_row[entry.token_ids[1:]], atol=LOGPROB_ATOL, rtol=0
    )
    # Rank 1-based among the whole vocabulary; values within the tolerance may order either way.
    chosen = hf_row[token_id]
    lowest = 1 + int((hf_row > chosen + LOGPROB_ATOL).sum())
    highest = int((hf_row > chosen - LOGPROB_ATOL).sum())
    assert lowest <= entry.rank <= highest


def test_logprobs_match_hf(case: ParityCase, batch_run: EngineRun) -> None:
    """Each generated token's logprob (and the top 5) against HF's log_softmax."""
    for i, prompt in enumerate(case.batch_prompts):
        record = batch_run.records[f"b{i}"]
        hf_rows = hf_logprobs(case.hf_model, prompt + record.token_ids)
        assert len(record.logprobs) == len(record.token_ids)
        for j, (token_id, entry) in enumerate(zip(record.token_ids, record.logprobs, strict=True)):
            row = hf_rows[len(prompt) - 1 + j]
            # Greedy, checked again without any padding in the reference.
            assert int(row.argmax()) == token_id, f"prompt {i} step {j}"
            assert_position_matches(entry, row, token_id, NUM_LOGPROBS)


def test_prompt_logprobs_match_hf(case: ParityCase, batch_run: EngineRun) -> None:
    for i, prompt in enumerate(case.batch_prompts):
        record = batch_run.records[f"b{i}"]
        if i % 2 == 0:
            assert record.prompt_logprobs is None
            continue
        assert record.prompt_logprobs is not None
        assert len(record.prompt_logprobs) == len(prompt)
        assert record.prompt_logprobs[0] is None  # nothing predicts the first token
        hf_rows = hf_logprobs(case.hf_model, prompt)
        for pos in range(1, len(prompt)):
            entry = record.prompt_logprobs[pos]
            assert entry is not None
            assert_position_matches(entry, hf_rows[pos - 1], prompt[pos], NUM_PROMPT_LOGPROBS)


# ---------------------------------------------------------------------------
# prefix caching
# ---------------------------------------------------------------------------


def test_prefix_caching_reuses_blocks_and_keeps_outputs(case: ParityCase) -> None:
    engine = case.engine
    prefix = random_prompts(7, 1, case.vocab_size, 5 * BLOCK_SIZE + 3, 5 * BLOCK_SIZE + 3)[0]
    tails = random_prompts(8, 4, case.vocab_size, 2, 9)
    prompts = [prefix + tail for tail in tails]
    expected = case.references(prompts)
    num_shared = (len(prefix) // BLOCK_SIZE) * BLOCK_SIZE  # whole blocks only
    params = greedy_params(case.max_new_tokens)

    # One after the other: the second finds the first's blocks in the cache.
    first = run_to_completion(engine, [AddRequest("p0", prompts[0], params, 0.0)])
    second = run_to_completion(engine, [AddRequest("p1", prompts[1], params, 0.0)])
    assert first.records["p0"].num_cached_tokens == 0
    assert second.records["p1"].num_cached_tokens == num_shared
    assert first.records["p0"].token_ids == expected[0]
    assert second.records["p1"].token_ids == expected[1]

    # After a reset nothing is found; two requests in the same step then
    # share the blocks the first of them is computing in that very step.
    assert engine.reset_prefix_cache()
    both = run_to_completion(
        engine,
        [AddRequest("p2", prompts[2], params, 0.0), AddRequest("p3", prompts[3], params, 0.0)],
    )
    assert both.records["p2"].num_cached_tokens == 0
    assert both.records["p3"].num_cached_tokens == num_shared
    assert both.records["p2"].token_ids == expected[2]
    assert both.records["p3"].token_ids == expected[3]
