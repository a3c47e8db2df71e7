"""Scheduler and block manager driven by a fake runner (no model, no torch).

The fake runner keeps the same per-request state the real one does and
checks every plan against it. Its "KV cache" stores, per slot, the token id
written there, and every scheduled request reads its whole context back
through its block table: a block that was shared, reused or freed wrongly
shows up as a wrong token. Sampled token ids are made up, which is fine:
this tests scheduling, not the model.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import pytest

from pagoda.engine_core.core.block_manager import BlockManager
from pagoda.engine_core.core.kv_offload import HostTier
from pagoda.engine_core.core.plan import SchedulePlan, StepResult
from pagoda.engine_core.core.request import Request
from pagoda.engine_core.core.scheduler import Scheduler
from pagoda.protocol.messages import Logprobs, RequestDelta
from pagoda.protocol.sampling_params import SamplingParams

BLOCK_SIZE = 4


def fake_token(request_id: str, position: int) -> int:
    """A made-up but reproducible sampled token id."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % 50


@dataclass
class FakeRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    wants_prompt_logprobs: bool
    pending: list[int] = field(default_factory=list)  # sampled, not yet sent back


class FakeRunner:
    """The model runner's bookkeeping, checked; a token-id 'KV cache'."""

    def __init__(self, num_blocks: int, block_size: int, keeps_tokens: bool = True) -> None:
        """`keeps_tokens` False: as under pipeline parallelism, the sampled tokens
        come back in the next plans (CachedRequestData.new_token_ids)."""
        self.block_size = block_size
        self.keeps_tokens = keeps_tokens
        self.host: dict[int, list[int | None]] = {}  # host tier slot -> a block's tokens
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.states: dict[str, FakeRequestState] = {}

    def execute(self, plan: SchedulePlan) -> StepResult:
        bs = self.block_size
        for block, slot in plan.kv_saves:  # the host tier's copies, saves first
            self.host[slot] = self.slots[block * bs : (block + 1) * bs]
        for slot, block in plan.kv_loads:
            self.slots[block * bs : (block + 1) * bs] = self.host[slot]
        for request_id in plan.finished_request_ids:
            assert request_id in self.states, f"told to forget unknown {request_id}"
            del self.states[request_id]
        for new in plan.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} added twice"
            self.states[new.request_id] = FakeRequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                wants_prompt_logprobs=new.sampling_params.prompt_logprobs is not None,
            )
        for cached in plan.cached_requests:
            assert cached.request_id in self.states, f"{cached.request_id} unknown to the runner"
            state = self.states[cached.request_id]
            assert cached.num_computed_tokens == state.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids)
            assert (
                self.keeps_tokens
                or cached.new_token_ids == state.pending[: len(cached.new_token_ids)]
            )
            if not self.keeps_tokens:
                state.token_ids.extend(cached.new_token_ids)
                del state.pending[: len(cached.new_token_ids)]

        result = StepResult()
        for request_id, n in plan.num_scheduled_tokens.items():
            state = self.states[request_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            assert n >= 1 and end <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= end, "too few blocks"
            for pos in range(start, end):
                self.slots[self._slot(state, pos)] = state.token_ids[pos]
            # "Attention": the whole context, read back through the block table.
            context = [self.slots[self._slot(state, pos)] for pos in range(end)]
            assert context == state.token_ids[:end], f"{request_id} reads a wrong KV block"
            if state.wants_prompt_logprobs and start < state.num_prompt_tokens - 1:
                last = min(end, state.num_prompt_tokens - 1)
                # The logprob encodes the position it is for.
                result.prompt_logprobs[request_id] = (
                    start,
                    [
                        Logprobs([state.token_ids[p + 1]], [-float(p + 1)], 1)
                        for p in range(start, last)
                    ],
                )
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                token_id = fake_token(request_id, end)
                if self.keeps_tokens:
                    state.token_ids.append(token_id)
                else:
                    state.pending.append(token_id)
                result.sampled_token_ids[request_id] = token_id
        return result

    def _slot(self, state: FakeRequestState, pos: int) -> int:
        return state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass
class Loop:
    """Scheduler + block manager + fake runner, stepped with checks after every step."""

    scheduler: Scheduler
    runner: FakeRunner
    plans: list[SchedulePlan] = field(default_factory=list)
    deltas: dict[str, list[RequestDelta]] = field(default_factory=dict)
    # Plans executed by the runner whose results the scheduler has not seen
    # (pipeline_depth > 1: the runner is ahead of the scheduler).
    in_flight: list[tuple[SchedulePlan, StepResult]] = field(default_factory=list)

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    def step(self) -> SchedulePlan:
        """Plans up to the pipeline depth, then the oldest one's update (as
        EngineCore.step); returns the plan updated."""
        while len(self.in_flight) < self.scheduler.pipeline_depth:
            plan = self.scheduler.schedule()
            assert plan.total_num_scheduled_tokens <= self.scheduler.max_num_batched_tokens
            assert len(plan.num_scheduled_tokens) <= self.scheduler.max_num_seqs
            assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
            for earlier, _ in self.in_flight:
                assert not set(plan.num_scheduled_tokens) & set(earlier.num_scheduled_tokens)
            if plan.is_empty and not plan.finished_request_ids and self.in_flight:
                break
            self.in_flight.append((plan, self.runner.execute(plan)))
        plan, result = self.in_flight.pop(0)
        for request, delta in self.scheduler.update(plan, result):
            self.deltas.setdefault(request.request_id, []).append(delta)
        self.block_manager.check_invariants()
        self.plans.append(plan)
        return plan

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                break
            plan = self.step()
            assert not plan.is_empty, "a step with work scheduled nothing"
        assert not self.scheduler.has_work(), "did not finish"
        self.assert_idle()

    def assert_idle(self) -> None:
        # One more plan tells the runner about the last requests that left.
        self.runner.execute(self.scheduler.schedule())
        assert self.runner.states == {}
        assert self.block_manager.num_free_blocks == self.block_manager.num_blocks
        assert self.scheduler.requests == {}

    def output_ids(self, request_id: str) -> list[int]:
        return [t for d in self.deltas.get(request_id, []) for t in d.new_token_ids]


def make_loop(
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    pipeline_depth: int = 1,
    host_blocks: int = 0,
) -> Loop:
    """`pipeline_depth` > 1: plans in flight as with pipeline stages, the
    runner's sampled tokens sent back in later plans."""
    tier = HostTier(host_blocks) if host_blocks else None
    bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching, tier)
    pipelined = pipeline_depth > 1
    scheduler = Scheduler(
        bm,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        sends_token_ids=pipelined,
        pipeline_depth=pipeline_depth,
    )
    return Loop(scheduler, FakeRunner(num_blocks, BLOCK_SIZE, keeps_tokens=not pipelined))


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 4,
    arrival_time: float = 0.0,
    priority: int = 0,
    prompt_logprobs: int | None = None,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Request(
        request_id,
        prompt_token_ids,
        params,
        eos_token_ids=[],
        arrival_time=arrival_time,
        priority=priority,
    )


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 2000) for _ in range(n)]


# ---------------------------------------------------------------------------


def test_chunked_prefill_respects_the_token_budget() -> None:
    loop = make_loop(max_num_batched_tokens=32)
    loop.scheduler.add_request(make_request("long", prompt(0, 100), max_tokens=3))
    loop.run()
    sizes = [plan.num_scheduled_tokens["long"] for plan in loop.plans]
    assert sizes == [32, 32, 32, 4, 1, 1]
    # Only the step that finishes the prompt produces the first token.
    assert [len(d.new_token_ids) for d in loop.deltas["long"]] == [1, 1, 1]
    assert loop.deltas["long"][-1].finish_reason == "length"


def test_decodes_and_a_prompt_chunk_share_the_budget() -> None:
    loop = make_loop(max_num_batched_tokens=32)
    for i in range(3):
        loop.scheduler.add_request(make_request(f"d{i}", prompt(i, 5), max_tokens=20))
    loop.step()  # three 5-token prompts
    loop.scheduler.add_request(make_request("long", prompt(9, 100), max_tokens=2))
    plan = loop.step()
    assert plan.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "long": 29}
    loop.run()


def test_max_num_seqs_is_respected() -> None:
    loop = make_loop(max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(10):
        loop.scheduler.add_request(make_request(f"r{i}", prompt(i, 6), max_tokens=5))
    loop.run()  # Loop.step asserts the cap on every plan
    assert max(len(plan.num_scheduled_tokens) for plan in loop.plans) == 3
    assert all(len(loop.output_ids(f"r{i}")) == 5 for i in range(10))


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_when_blocks_run_out_and_everyone_finishes(enable_prefix_caching: bool) -> None:
    # 12 blocks of 4 = 48 slots for 6 requests that each grow to 8 + 12 = 20 tokens.
    loop = make_loop(num_blocks=12, enable_prefix_caching=enable_prefix_caching)
    for i in range(6):
        # Same arrival time for all, as in an offline batch.
        loop.scheduler.add_request(make_request(f"r{i}", prompt(i, 8), max_tokens=12))
    preempted: set[str] = set()
    while loop.scheduler.has_work():
        loop.step()
        preempted |= {r.request_id for r in loop.scheduler.waiting if r.num_preemptions}
    loop.assert_idle()
    assert loop.scheduler.num_preemptions > 0
    assert preempted
    for i in range(6):
        outputs = loop.output_ids(f"r{i}")
        # Every token was sampled exactly once: nothing lost or repeated on resume.
        assert outputs == [fake_token(f"r{i}", 8 + k) for k in range(12)]
        assert loop.deltas[f"r{i}"][-1].finish_reason == "length"


def test_the_newest_request_is_preempted_first() -> None:
    loop = make_loop(num_blocks=6)
    loop.scheduler.add_request(make_request("old", prompt(0, 8), max_tokens=12, arrival_time=1.0))
    loop.scheduler.add_request(make_request("new", prompt(1, 8), max_tokens=12, arrival_time=2.0))
    while loop.scheduler.num_preemptions == 0:
        loop.step()
    assert [r.request_id for r in loop.scheduler.waiting] == ["new"]
    assert [r.request_id for r in loop.scheduler.running] == ["old"]
    loop.run()


def test_preempting_a_request_already_planned_this_step_is_avoided() -> None:
    """The oldest request runs first; when a later one is short of blocks, the
    victim must come from the requests not yet in this step's plan."""
    loop = make_loop(num_blocks=5)
    loop.scheduler.add_request(make_request("a", prompt(0, 7), max_tokens=9, arrival_time=5.0))
    loop.scheduler.add_request(make_request("b", prompt(1, 7), max_tokens=9, arrival_time=1.0))
    loop.run()  # the fake runner fails on a plan for a request it was told to forget
    assert loop.scheduler.num_preemptions > 0
    assert len(loop.output_ids("a")) == len(loop.output_ids("b")) == 9


def test_abort_frees_blocks_at_once() -> None:
    loop = make_loop(num_blocks=32)
    loop.scheduler.add_request(make_request("keep", prompt(0, 10), max_tokens=6))
    loop.scheduler.add_request(make_request("running", prompt(1, 20), max_tokens=50))
    loop.step()
    loop.step()
    bm = loop.block_manager
    held = len(bm.get_block_ids("running"))
    assert held > 0
    free_before = bm.num_free_blocks
    loop.scheduler.add_request(make_request("waiting", prompt(2, 10), max_tokens=6))

    aborted = loop.scheduler.finish_requests(["running", "waiting", "unknown"], "abort")
    assert [r.request_id for r in aborted] == ["running", "waiting"]
    assert all(r.finish_reason == "abort" and r.is_finished for r in aborted)
    assert bm.num_free_blocks == free_before + held
    bm.check_invariants()
    assert "running" not in loop.scheduler.requests
    assert loop.scheduler.finish_requests(["running"]) == []  # twice is harmless

    plan = loop.step()
    assert "running" in plan.finished_request_ids  # the runner is told
    assert "running" not in loop.runner.states
    loop.run()
    assert len(loop.output_ids("keep")) == 6


def test_prompt_logprobs_survive_chunking_and_preemption() -> None:
    loop = make_loop(num_blocks=10, max_num_batched_tokens=6)
    prompts = {f"r{i}": prompt(i, 13 + i) for i in range(4)}
    for request_id, token_ids in prompts.items():
        loop.scheduler.add_request(make_request(request_id, token_ids, 6, prompt_logprobs=1))
    loop.run()
    assert loop.scheduler.num_preemptions > 0
    for request_id, token_ids in prompts.items():
        first, *rest = loop.deltas[request_id]
        assert all(d.prompt_logprobs is None for d in rest)
        assert first.prompt_logprobs is not None
        entries = first.prompt_logprobs
        assert entries[0] is None
        assert len(entries) == len(token_ids)
        for pos in range(1, len(token_ids)):
            entry = entries[pos]
            assert entry is not None
            assert entry.token_ids[0] == token_ids[pos]
            assert entry.logprobs[0] == -float(pos)


def test_one_token_prompt_with_prompt_logprobs() -> None:
    loop = make_loop()
    loop.scheduler.add_request(make_request("one", [5], max_tokens=2, prompt_logprobs=0))
    loop.run()
    assert loop.deltas["one"][0].prompt_logprobs == [None]


def test_max_model_len_ends_a_request() -> None:
    loop = make_loop(max_model_len=12)
    loop.scheduler.add_request(make_request("r", prompt(0, 8), max_tokens=100))
    loop.run()
    assert len(loop.output_ids("r")) == 4
    assert loop.deltas["r"][-1].finish_reason == "length"


@pytest.mark.parametrize(("depth", "host_blocks"), [(1, 0), (2, 0), (3, 0), (1, 6), (2, 3)])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload(seed: int, depth: int, host_blocks: int) -> None:
    """Shared prefixes, arrivals over time, aborts and tight blocks, all checked;
    with `depth` plans in flight as pipeline stages keep them, and a host tier
    of `host_blocks` whose copies the fake runner makes (a wrong copy shows as
    a wrong context)."""
    rng = random.Random(seed)
    enable_prefix_caching = seed % 2 == 0
    num_blocks = rng.randint(12, 40)
    max_model_len = num_blocks * BLOCK_SIZE
    loop = make_loop(
        num_blocks=num_blocks,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(1, 48),
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        pipeline_depth=depth,
        host_blocks=host_blocks,
    )
    prefixes = [prompt(100 + k, rng.randint(1, 20)) for k in range(3)]
    pending: list[Request] = []
    for i in range(30):
        tokens = rng.choice(prefixes) + prompt(1000 * seed + i, rng.randint(1, 15))
        pending.append(
            make_request(
                f"r{i}",
                tokens[: max_model_len - 1],
                max_tokens=rng.randint(1, 12),
                arrival_time=float(rng.randint(0, 5)),
                priority=rng.choice([0, 0, 1]),
                prompt_logprobs=rng.choice([None, None, 2]),
            )
        )
    lengths = {r.request_id: r.prompt_token_ids for r in pending}
    aborted: set[str] = set()
    for _ in range(5000):
        if pending and rng.random() < 0.5:
            loop.scheduler.add_request(pending.pop(0))
        if loop.scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(loop.scheduler.requests))
            loop.scheduler.finish_requests([victim])
            loop.block_manager.check_invariants()
            aborted.add(victim)
        if not pending and not loop.scheduler.has_work() and not loop.in_flight:
            break
        if loop.scheduler.has_work() or loop.in_flight:
            loop.step()
    loop.assert_idle()
    for i in range(30):
        request_id = f"r{i}"
        if request_id in aborted:
            continue
        deltas = loop.deltas[request_id]
        assert deltas[-1].finish_reason == "length"
        assert sum(len(d.new_token_ids) for d in deltas) >= 1
        # Each token is the one made up for its position: the runner read the
        # right context, whichever plan its tokens came back in.
        first = len(lengths[request_id])
        outputs = loop.output_ids(request_id)
        assert outputs == [fake_token(request_id, first + k) for k in range(len(outputs))]
    if enable_prefix_caching:
        assert loop.block_manager.num_prefix_hits > 0
