"""Helpers for engine-core tests: drive an EngineCore to completion, size KV budgets."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.core.plan import SchedulePlan, StepResult
from pagoda.engine_core.model_config import ModelConfig
from pagoda.protocol.messages import AddRequest, Logprobs
from pagoda.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda import LLM

# One intra-op thread: the test machine has two cores that other work shares,
# and two OpenMP threads on one free core run many times slower than one.
NUM_THREADS = 1


@dataclass
class RequestRecord:
    """Everything one request produced over its life in the engine."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class EngineRun:
    """The records of a run, by request id, and the plans that were executed."""

    records: dict[str, RequestRecord]
    plans: list[SchedulePlan]


def random_prompts(
    seed: int, num_prompts: int, vocab_size: int, min_len: int, max_len: int
) -> list[list[int]]:
    """Prompts of random token ids with lengths in [min_len, max_len]."""
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_prompts)
    ]


def assert_answers_paris(llm: LLM) -> None:
    """The default model's reference answer (FACTS.md), greedy through its chat template."""
    chat = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=12),
        use_tqdm=False,
    )
    assert chat[0].outputs[0].text == "The capital of France is Paris."


def greedy_params(max_tokens: int, **kwargs: object) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def run_to_completion(engine: EngineCore, requests: list[AddRequest]) -> EngineRun:
    """Add the requests, step until idle, check the block bookkeeping after every step.

    At the end every block must be free again (cached blocks count as free).
    """
    records = {r.request_id: RequestRecord() for r in requests}
    plans: list[SchedulePlan] = []
    executor = engine.executor
    submit, collect = executor.submit, executor.collect

    def recording_submit(plan: SchedulePlan) -> None:
        plans.append(plan)
        # Plan and result pass through their wire form, as they would to and
        # from a worker in another process: plain data, nothing live.
        submit(msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=SchedulePlan))

    def recording_collect() -> StepResult:
        result = collect()
        return msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=StepResult)

    executor.submit = recording_submit  # type: ignore[method-assign]
    executor.collect = recording_collect  # type: ignore[method-assign]
    try:
        for add in requests:
            error = engine.add_request(add)
            assert error is None, error
        block_manager = engine.scheduler.block_manager
        while engine.has_work():
            for request, delta in engine.step():
                record = records[request.request_id]
                assert record.finish_reason is None, "a delta after the request finished"
                record.token_ids.extend(delta.new_token_ids)
                if delta.new_logprobs is not None:
                    record.logprobs.extend(delta.new_logprobs)
                if delta.prompt_logprobs is not None:
                    assert record.prompt_logprobs is None, "prompt logprobs sent twice"
                    record.prompt_logprobs = delta.prompt_logprobs
                record.num_cached_tokens = delta.num_cached_tokens
                record.finish_reason = delta.finish_reason
            block_manager.check_invariants()
    finally:
        del executor.submit, executor.collect  # back to the class's methods
    assert block_manager.num_free_blocks == block_manager.num_blocks
    assert all(r.finish_reason is not None for r in records.values())
    return EngineRun(records, plans)


def kv_bytes_for_blocks(
    model_config: ModelConfig, num_blocks: int, block_size: int, dtype_bytes: int = 4
) -> int:
    """The kv_cache_memory_bytes that buys exactly `num_blocks` blocks."""
    mc = model_config
    per_block = 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * dtype_bytes
    return num_blocks * per_block
