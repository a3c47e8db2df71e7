"""Scheduler: continuous batching with chunked prefill and preemption.

Imports no torch. Each step has a token budget (`max_num_batched_tokens`)
and a cap on sequences (`max_num_seqs`). Running requests are served first,
then waiting ones; a prompt longer than the budget left is chunked. When
blocks run out, the lowest-priority, newest running request not yet
scheduled in this step is preempted: its blocks are freed and it is
recomputed later (prefix caching usually gives most of them back).

Under pipeline parallelism up to `pipeline_depth` plans are in flight at
once (one per stage): a request in a plan not yet back is not scheduled
again (its next token is not known), and each plan takes an even share of
the requests, so the stages have something to work on while the others do.

Pooling requests are never chunked and never use the prefix cache: each is
scheduled whole in one step (an encoder attends in both directions and the
pooled vector needs every token's hidden state), batched with the other
requests of that step, and finishes in that step's update with its vector.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from pagoda.engine_core.core.block_manager import BlockManager
from pagoda.engine_core.core.kv_connector import PeerConnector
from pagoda.engine_core.core.lora_slots import LoRASlots
from pagoda.engine_core.core.plan import CachedRequestData, NewRequestData, SchedulePlan, StepResult
from pagoda.engine_core.core.request import Request, RequestStatus
from pagoda.engine_core.core.spec_decode import NgramProposer, SpeculativeConfig
from pagoda.protocol.messages import RequestDelta, SchedulerStats


class Scheduler:
    """Decides what each step computes and applies what it produced."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        lora_slots: LoRASlots | None = None,
        sends_token_ids: bool = False,
        pipeline_depth: int = 1,
        speculative: SpeculativeConfig | None = None,
        max_step_tokens_with_drafts: int | None = None,
    ) -> None:
        """`sends_token_ids`: the workers keep no sampled tokens (pipeline
        parallelism); each plan brings them a request's tokens since the last.
        `pipeline_depth`: how many plans may be in flight at once.
        `speculative`: prompt-lookup drafts for decoding requests (not with
        pipeline parallelism). `max_step_tokens_with_drafts`: drafts stop where
        a step's decoding requests and drafts would pass this many tokens
        (None: no cap): past the size where a step's cost grows with its
        tokens, a rejected draft costs as much as a token kept."""
        self.block_manager = block_manager
        # With LoRA: a request runs only while its adapter holds a slot, so a
        # step never names more adapters than there are slots.
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner holds state for; told when they leave.
        self._runner_known: set[str] = set()
        # With sends_token_ids: how many of each request's tokens the runner has.
        self._runner_tokens: dict[str, int] | None = {} if sends_token_ids else None
        self.pipeline_depth = pipeline_depth
        # Requests in plans whose results are not back yet (pipeline_depth > 1),
        # as scheduled: one aborted and replaced under its id is another object.
        self.in_flight: dict[str, Request] = {}
        # Paused in "keep" mode: nothing is scheduled; requests keep their blocks.
        self.frozen = False
        self._finished_since_last_plan: list[str] = []
        self.num_preemptions = 0
        # Prompt positions run through the model (not found cached or pulled).
        self.num_prompt_tokens_computed = 0
        # KV transfers between engines (core/kv_connector.py): a producer holds
        # finished requests' blocks for consumers; the engine sets this.
        self.connector: PeerConnector | None = None
        # Speculative decoding (core/spec_decode.py) and its counters.
        self.proposer: NgramProposer | None = None
        if speculative is not None and pipeline_depth == 1 and not sends_token_ids:
            self.proposer = NgramProposer(speculative)
        self.max_step_tokens_with_drafts = max_step_tokens_with_drafts
        self.num_spec_drafts = 0  # steps that verified drafts (request-steps)
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        self.num_spec_accepted_per_pos: list[int] = (
            [0] * speculative.num_speculative_tokens if speculative is not None else []
        )

    # ----------------------------------------------------------------- intake

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], reason: str = "abort") -> list[Request]:
        """End requests from outside the step (abort, client gone)."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason = reason
            self._free(request)
            finished.append(request)
        return finished

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulePlan:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        spec_token_ids: dict[str, list[int]] = {}
        draft_budget = self._draft_budget()
        preempted_now = False
        in_flight = self.in_flight
        # With plans in flight, each takes an even share of the requests.
        share = self.max_num_seqs
        if self.pipeline_depth > 1:
            share = max(-(-self.num_unfinished // self.pipeline_depth), 1)

        # 1. Running requests first, in order; preempt from the back if short.
        i = 0
        while i < len(self.running) and budget > 0 and not self.frozen:
            request = self.running[i]
            if request.request_id in in_flight or len(num_scheduled) >= share:
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            draft = self._draft(request, min(budget, draft_budget + 1)) if num_new == 1 else []
            draft_budget -= len(draft)
            num_new += len(draft)
            num_old_blocks = len(self.block_manager.get_block_ids(request.request_id))
            while not self.block_manager.allocate_slots(request, num_new):
                if draft:  # short of blocks: the drafts go before anyone is preempted
                    draft, num_new = [], 1
                    continue
                # Only requests not yet in this step's plan (nor in flight) may
                # go: one already planned would reach the runner after being
                # forgotten.
                victim = max(
                    (r for r in self.running[i:] if r.request_id not in in_flight),
                    key=lambda r: (r.priority, r.arrival_time),
                )
                self._preempt(victim)
                preempted_now = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # it preempted itself; self.running[i] is the next one
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if draft:
                spec_token_ids[request.request_id] = draft
            block_ids = self.block_manager.get_block_ids(request.request_id)
            new_token_ids: list[int] = []
            if self._runner_tokens is not None:
                known = self._runner_tokens[request.request_id]
                new_token_ids = request.all_token_ids[known:]
                self._runner_tokens[request.request_id] = request.num_tokens
            cached_reqs.append(
                CachedRequestData(
                    request_id=request.request_id,
                    new_block_ids=block_ids[num_old_blocks:],
                    num_computed_tokens=request.num_computed_tokens,
                    new_token_ids=new_token_ids,
                )
            )
            i += 1

        # 2. Waiting requests, unless this step had to preempt.
        while self.waiting and not preempted_now and budget > 0 and not self.frozen:
            if len(self.running) >= self.max_num_seqs or len(num_scheduled) >= share:
                break
            ready = next(
                (
                    r
                    for r in self.waiting
                    if r.is_ready
                    and not r.held
                    and not r.kv_pull_pending
                    and self._lora_fits(r)
                    and r.request_id not in in_flight
                ),
                None,
            )
            if ready is None:
                break  # the rest wait for their grammars to compile
            request = ready
            computed: list[int] | None = []
            num_hit = 0
            if request.request_id in self.block_manager.req_blocks:
                # Its KV was pulled from a producer: it holds blocks for the whole
                # prompt and computes the last prompt token (core/kv_connector.py).
                computed, num_hit = None, request.num_computed_tokens
            elif request.is_pooling:
                if request.num_tokens > budget:
                    break  # whole or not at all; the next step has a fresh budget
            elif request.sampling_params.prompt_logprobs is None:
                # Prompt logprobs need every prompt position computed.
                computed, num_hit = self.block_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.block_manager.allocate_slots(request, num_new, computed):
                break
            self.waiting.remove(request)
            if request.lora_name is not None and self.lora_slots is not None:
                request.lora_slot = self.lora_slots.acquire(request.lora_name)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            if request.scheduled_at is None:
                request.scheduled_at = time.monotonic()
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(
                NewRequestData(
                    request_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    block_ids=list(self.block_manager.get_block_ids(request.request_id)),
                    num_computed_tokens=num_hit,
                    sampling_params=request.sampling_params,
                    pooling_params=request.pooling_params,
                    lora_slot=request.lora_slot,
                    encoder_features=request.encoder_features,
                )
            )
            self._runner_known.add(request.request_id)
            if self._runner_tokens is not None:
                self._runner_tokens[request.request_id] = request.num_tokens

        if self.pipeline_depth > 1:
            for request_id in num_scheduled:
                in_flight[request_id] = self.requests[request_id]
        finished = self._finished_since_last_plan
        self._finished_since_last_plan = []
        loads = self.lora_slots.take_pending_loads() if self.lora_slots is not None else []
        kv_saves: list[tuple[int, int]] = []
        kv_loads: list[tuple[int, int]] = []
        if self.block_manager.host_tier is not None:
            kv_saves, kv_loads = self.block_manager.host_tier.take_copies()
        return SchedulePlan(
            new_requests=new_reqs,
            cached_requests=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            finished_request_ids=finished,
            lora_loads=loads,
            kv_saves=kv_saves,
            kv_loads=kv_loads,
            spec_token_ids=spec_token_ids,
        )

    # ----------------------------------------------------------------- update

    def update(
        self,
        plan: SchedulePlan,
        result: StepResult,
        grammar_terminated: frozenset[str] | set[str] = frozenset(),
    ) -> list[tuple[Request, RequestDelta]]:
        """Advance progress, append sampled tokens, apply stop rules.

        `grammar_terminated`: requests whose grammar reached its end with this
        step's token (they stop). Returns (request, delta) for every request
        that produced something.
        """
        deltas: list[tuple[Request, RequestDelta]] = []
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if self.in_flight.pop(request_id, request) is not request:
                continue  # aborted while in flight, and its id taken again
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            self.num_prompt_tokens_computed += max(
                min(num_tokens, request.num_prompt_tokens - request.num_computed_tokens), 0
            )
            request.num_computed_tokens += num_tokens
            chunk = result.prompt_logprobs.get(request_id)
            if chunk is not None:
                start, chunk_logprobs = chunk
                # The chunk covers positions start + 1 .. start + len(chunk). A
                # request recomputed after preemption sees positions again, in
                # chunks that need not line up with the first pass: keep the new.
                num_known = len(request.prompt_logprobs) - (start + 1)
                assert num_known >= 0, "prompt logprobs skipped a position"
                request.prompt_logprobs.extend(chunk_logprobs[num_known:])
            pooled = result.pooled.get(request_id)
            if pooled is not None:
                request.finish_reason = "stop"
                request.first_token_at = time.monotonic()
                delta = RequestDelta(
                    request_id, [], finish_reason="stop", pooled=pooled, timings=request.timings()
                )
                self.running.remove(request)
                self._free(request)
                deltas.append((request, delta))
                continue
            token_id = result.sampled_token_ids.get(request_id)
            if token_id is None:
                continue  # a prompt chunk that does not reach the end yet
            new_token_ids = [token_id]
            logprobs = result.logprobs.get(request_id)
            new_logprobs = [logprobs] if logprobs is not None else None
            draft = plan.spec_token_ids.get(request_id)
            if draft is not None:
                new_token_ids = result.accepted_token_ids.get(request_id, new_token_ids)
                if new_logprobs is not None:
                    new_logprobs = result.accepted_logprobs.get(request_id, new_logprobs)
                num_accepted = len(new_token_ids) - 1
                self._count_spec(request_id, len(draft), num_accepted)
                # The rejected drafts' positions hold garbage KV: not computed
                # (the next steps write them again, and block_manager caches
                # blocks only up to the request's real tokens).
                request.num_computed_tokens -= len(draft) - num_accepted
            is_first = request.num_output_tokens == 0
            if request.first_token_at is None:
                request.first_token_at = time.monotonic()
            # The stop rules apply after each token: a stop mid-draft drops the rest.
            done = False
            for num_new, token_id in enumerate(new_token_ids, 1):
                request.append_output_token(token_id)
                done = request.check_stop(self.max_model_len)
                if done:
                    new_token_ids = new_token_ids[:num_new]
                    break
            if not done and request_id in grammar_terminated:
                request.finish_reason = "stop"
                done = True
            if new_logprobs is not None:
                new_logprobs = new_logprobs[: len(new_token_ids)]
            delta = RequestDelta(
                request_id=request_id,
                new_token_ids=new_token_ids,
                new_logprobs=new_logprobs,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            if is_first and request.sampling_params.prompt_logprobs is not None:
                delta.prompt_logprobs = list(request.prompt_logprobs)
            if done:
                delta.finish_reason = request.finish_reason
                delta.stop_reason = request.stop_reason
                delta.timings = request.timings()
                self.running.remove(request)
                self._free(request)
                delta.kv_transfer_params = request.kv_transfer_out
            deltas.append((request, delta))
        return deltas

    def stats(self) -> SchedulerStats:
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.block_manager.num_prefix_queries,
            prefix_cache_hits=self.block_manager.num_prefix_hits,
            prompt_tokens_computed=self.num_prompt_tokens_computed,
            spec_decode_num_drafts=self.num_spec_drafts,
            spec_decode_num_draft_tokens=self.num_spec_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_spec_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.num_spec_accepted_per_pos),
        )
        if self.connector is not None:
            peer = self.connector.stats
            stats.kv_transfers = peer.transfers
            stats.kv_transfer_tokens = peer.transfer_tokens
            stats.kv_transfer_bytes = peer.transfer_bytes
            stats.kv_transfer_seconds = peer.transfer_seconds
            stats.kv_recomputed = peer.recomputed
            stats.kv_served = peer.served
            stats.kv_expired = peer.expired
        return stats

    # -------------------------------------------------------------- internals

    def _draft_budget(self) -> int:
        """Draft tokens this step may carry in all."""
        cap = self.max_step_tokens_with_drafts
        if self.proposer is None or cap is None:
            return 1 << 31
        decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        return max(cap - decoding, 0)

    def _draft(self, request: Request, budget: int) -> list[int]:
        """Prompt-lookup drafts for a decoding request ([] where it runs without).

        Drafts past max_tokens or max_model_len could never be kept, so none
        are proposed there; nor for what the first slice does not verify:
        penalties, logit bias, prompt logprobs, structured output, pooling.
        """
        proposer = self.proposer
        if proposer is None or request.num_tokens - request.num_computed_tokens != 1:
            return []
        limit = proposer.config.disable_by_batch_size
        if limit is not None and self.num_unfinished > limit:
            return []
        p = request.sampling_params
        if (
            request.is_pooling
            or request.grammar is not None
            or p.needs_penalties
            or p.logit_bias
            or p.prompt_logprobs is not None
        ):
            return []
        max_drafts = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if max_drafts <= 0:
            return []
        return proposer.propose(request.request_id, request.all_token_ids, max_drafts)

    def _count_spec(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_drafts
        self.num_spec_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_spec_accepted_per_pos[pos] += 1
        assert self.proposer is not None
        self.proposer.record(request_id, num_drafts, num_accepted)

    def _lora_fits(self, request: Request) -> bool:
        if request.lora_name is None or self.lora_slots is None:
            return True
        return self.lora_slots.can_acquire(request.lora_name)

    def _release_lora(self, request: Request) -> None:
        if request.lora_slot and request.lora_name is not None and self.lora_slots is not None:
            self.lora_slots.release(request.lora_name)
        request.lora_slot = 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_lora(request)
        self.block_manager.free(request)
        self._forget_in_runner(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        self._release_lora(request)
        request.status = RequestStatus.FINISHED
        params = request.kv_transfer_params
        if (
            self.connector is not None
            and params
            and params.get("do_remote_decode")
            and request.finish_reason in ("stop", "length")
        ):
            # A prefill for another engine: the prompt's blocks stay until the
            # consumer has pulled them (or the connector's timeout).
            blocks = self.block_manager.get_block_ids(request.request_id)
            key, request.kv_transfer_out = self.connector.request_finished(
                request.request_id, request.prompt_token_ids, blocks
            )
            self.block_manager.hold(request.request_id, key)
        else:
            self.block_manager.free(request)
        self._forget_in_runner(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        del self.requests[request.request_id]

    def _forget_in_runner(self, request_id: str) -> None:
        if self._runner_tokens is not None:
            self._runner_tokens.pop(request_id, None)
        if request_id in self._runner_known:
            self._runner_known.discard(request_id)
            self._finished_since_last_plan.append(request_id)
