"""What crosses the executor seam each step: the plan and its result.

The engine core hands a `SchedulePlan` to `executor.execute` and gets a
`StepResult` back. Both are msgspec Structs of plain values (ids, counts,
block ids, sampling parameters, bytes), so an executor whose workers live in
other processes or on other hosts sends them as they are
(`msgspec.msgpack.encode(plan)`); nothing here is a live object, a tensor or
a callable. New requests travel in full; continuing ones as small diffs
against the worker's cached state. No torch here.
"""

from __future__ import annotations

import msgspec

from pagoda.protocol.messages import Logprobs
from pagoda.protocol.pooling_params import PoolingParams
from pagoda.protocol.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the worker has not seen (or sees again after preemption)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    # Set for a pooling request: all of its tokens are scheduled in this step.
    pooling_params: PoolingParams | None = None
    # The LoRA slot whose adapter the request runs with (0: the base model).
    lora_slot: int = 0
    # A transcription request's log-mel features (AddRequest.encoder_features):
    # the worker encodes them when it (re)admits the request.
    encoder_features: bytes | None = None


class CachedRequestData(msgspec.Struct, kw_only=True):
    """A request the worker already holds: its new blocks and progress."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Under pipeline parallelism, the tokens sampled since the worker last saw
    # the request (no rank keeps what it samples: one stage samples for all).
    new_token_ids: list[int] = msgspec.field(default_factory=list)


class GrammarBitmask(msgspec.Struct, kw_only=True):
    """The tokens each constrained request may sample this step.

    `data` holds one row per id in `request_ids`, `words` little-endian
    int32 per row (xgrammar's layout: bit j of word i allows token 32 i + j).
    The engine core keeps the grammar matchers and fills this before the step;
    the worker masks those rows' logits with it.
    """

    request_ids: list[str]
    words: int
    data: bytes


class SchedulePlan(msgspec.Struct, kw_only=True):
    """What to compute this step."""

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens this step
    finished_request_ids: list[str] = msgspec.field(default_factory=list)
    # (slot, adapter name): adapters to copy into their slots before this step.
    lora_loads: list[tuple[int, str]] = msgspec.field(default_factory=list)
    grammar_bitmask: GrammarBitmask | None = None
    # The host KV tier (core/kv_offload.py), run before the forward pass, saves
    # first: (device block, host slot) copied out, (host slot, device block) back in.
    kv_saves: list[tuple[int, int]] = msgspec.field(default_factory=list)
    kv_loads: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # Speculative decoding: request id -> draft tokens to verify. Such a request
    # is scheduled 1 + len(drafts) tokens (its last sampled token, then the
    # drafts) and samples at each of those positions.
    spec_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class StepResult(msgspec.Struct, kw_only=True):
    """What the worker computed: sampled tokens (and logprobs) by request id."""

    sampled_token_ids: dict[str, int] = msgspec.field(default_factory=dict)
    # Requests verified with drafts: every token the step produced for them,
    # the accepted drafts then the target's own (sampled_token_ids holds the first).
    accepted_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Their logprobs, one per token of accepted_token_ids (logprobs holds the first).
    accepted_logprobs: dict[str, list[Logprobs]] = msgspec.field(default_factory=dict)
    logprobs: dict[str, Logprobs] = msgspec.field(default_factory=dict)
    # request id -> logprobs of prompt positions [start, end) computed this step
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = msgspec.field(default_factory=dict)
    # Pooling requests' vectors: little-endian float32 bytes.
    pooled: dict[str, bytes] = msgspec.field(default_factory=dict)
