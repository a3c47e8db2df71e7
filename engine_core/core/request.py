"""Request: the engine's state of one sequence. Imports no torch.

One progress counter, `num_computed_tokens`, catches up with `num_tokens`.
There is no prefill or decode phase: a fresh prompt, a chunked prompt, a
prefix-cache hit and a recompute after preemption are all "computed < total".
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from typing import Any

from pagoda.protocol.messages import Logprobs, RequestTimings
from pagoda.protocol.pooling_params import PoolingParams
from pagoda.protocol.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """One sequence in the engine: prompt, outputs, progress, stop rules."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        arrival_time: float,
        client_id: str = "",
        priority: int = 0,
        lora_name: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_id: int = 0,
        cache_salt: str | None = None,
        encoder_features: bytes | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        # A KV connector's parameters in (core/kv_connector.py), and out on
        # the last delta; `kv_pull_pending`: its KV is still to be pulled.
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_out: dict[str, Any] | None = None
        self.kv_pull_pending = bool(
            kv_transfer_params and kv_transfer_params.get("do_remote_prefill")
        )
        # A transcription request's log-mel features, sent again after preemption.
        self.encoder_features = encoder_features
        self.cache_salt = cache_salt
        self.client_id = client_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        # When this engine queued it (its own clock): --max-queue-wait counts from here.
        self.queued_at = time.monotonic()
        self.scheduled_at: float | None = None  # first scheduled (engine clock)
        self.first_token_at: float | None = None
        self.priority = priority
        self.lora_name = lora_name
        # The engine's id of this registration of the adapter: an adapter removed
        # and loaded again under the same name never finds the old one's blocks.
        self.lora_id = lora_id
        self.lora_slot = 0  # the device slot while running (0: none held)
        # A pooling request is computed whole in one step and then finishes.
        self.pooling_params = pooling_params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first scheduling
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        # Prompt logprobs computed so far (filled chunk by chunk); nothing
        # predicts the first prompt token.
        self.prompt_logprobs: list[Logprobs | None] = [None]
        # The compiled output grammar, when structured_outputs is set; the
        # request waits until compilation is done.
        self.grammar: Future[Any] | None = None
        # Its xgrammar GrammarMatcher once scheduled, advanced token by token
        # by the engine core (it survives preemption: nothing to replay).
        self.matcher: Any = None
        # Arrived while the engine was paused: not scheduled until resume.
        self.held = False
        self.held_at = 0.0
        # (weight version, first, end) over its output tokens, end exclusive.
        self.weight_versions: list[tuple[int | str, int, int]] = []

    def note_weight_version(self, version: int | str, num_new: int) -> None:
        """Its last `num_new` output tokens came from weights `version`."""
        end = self.num_output_tokens
        ranges = self.weight_versions
        if ranges and ranges[-1][0] == version and ranges[-1][2] == end - num_new:
            ranges[-1] = (version, ranges[-1][1], end)
        else:
            ranges.append((version, end - num_new, end))

    @property
    def is_ready(self) -> bool:
        """Schedulable: no grammar, or one that compiled (the engine reaps failures)."""
        g = self.grammar
        return g is None or (g.done() and g.exception() is None)

    def timings(self) -> RequestTimings:
        """Queue, prefill and decode time, for a request that just finished."""
        done = time.monotonic()
        scheduled = self.scheduled_at if self.scheduled_at is not None else done
        first = self.first_token_at if self.first_token_at is not None else done
        return RequestTimings(scheduled - self.queued_at, first - scheduled, done - first)

    @property
    def lora_cache_key(self) -> tuple[str | None, int, str | None] | None:
        """What the prefix cache keys blocks by besides their tokens: the
        adapter and the cache salt."""
        if self.lora_name is None and self.cache_salt is None:
            return None
        return (self.lora_name, self.lora_id, self.cache_salt)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_tokens(self) -> int:
        # The frontend always sets max_tokens; None means "up to the limit".
        mt = self.sampling_params.max_tokens
        return mt if mt is not None else 1 << 31

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Apply the engine-side stop rules after a new token; True if done."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.finish_reason = "stop"
                return True
            if last in params.stop_token_ids:
                self.finish_reason = "stop"
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
            return True
        return False
