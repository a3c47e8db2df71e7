"""The typed plan a scheduler step hands to the model runner, and its result.

Plain dataclasses; no torch, no scheduler objects. New requests travel in
full; continuing ones as small diffs against the runner's cached state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.messages import Logprobs
from protocol.pooling_params import PoolingParams
from protocol.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    # An xgrammar CompiledGrammar when the output is constrained.
    grammar: Any = None
    # Set for a pooling request: all of its tokens are scheduled in this step.
    pooling_params: PoolingParams | None = None
    # The LoRA slot whose adapter the request runs with (0: the base model).
    lora_slot: int = 0


@dataclass
class CachedRequestData:
    """A request the runner already holds: its new blocks and progress."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulePlan:
    """What to compute this step, in batch order."""

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens this step
    finished_request_ids: list[str] = field(default_factory=list)
    # (slot, adapter name): adapters to copy into their slots before this step.
    lora_loads: list[tuple[int, str]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class StepResult:
    """What the runner computed: sampled tokens (and logprobs) by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # request id -> logprobs of prompt positions [start, end) computed this step
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)
    # Requests whose grammar reached its end with this step's token.
    grammar_terminated: set[str] = field(default_factory=set)
    # Pooling requests' vectors: little-endian float32 bytes.
    pooled: dict[str, bytes] = field(default_factory=dict)
