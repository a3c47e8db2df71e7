"""Messages between API servers (frontends) and engine cores.

msgspec Structs only, one tagged union per direction. Frontend → engine:
Hello, AddRequest, Abort, UtilityCall, Heartbeat. Engine → frontend: Ready,
Outputs, UtilityResult, EngineDead. Decoding goes by tag into these types and
nothing else; no pickle anywhere.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagoda.protocol.pooling_params import PoolingParams
from pagoda.protocol.sampling_params import SamplingParams

PROTOCOL_VERSION = 1


# ----------------------------------------------------------------------------
# frontend → engine
# ----------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    """First message of a frontend: who it is and which protocol it speaks."""

    client_id: str
    protocol_version: int


class LoRARequest(msgspec.Struct, omit_defaults=True):
    """A LoRA adapter by name (vLLM's LoRARequest): the engine loads `lora_path`
    under `lora_name` if it does not know that name yet. `lora_int_id` is the
    caller's id for it; the engine keys its own state by name."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


class AddRequest(msgspec.Struct, tag="add", omit_defaults=True):
    """A new request, already tokenized.

    With `pooling_params` set it is a pooling request: the engine computes the
    prompt once and answers with the pooled vector; `sampling_params` is then
    ignored.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    # Cached prefix blocks are shared only among requests with the same salt
    # (vLLM's cache_salt: one tenant cannot probe another's prompts by timing).
    cache_salt: str | None = None
    # A transcription request (Whisper): little-endian float32 log-mel features
    # [n_mels, 3000] (one 30 s window); prompt_token_ids are the decoder prompt.
    encoder_features: bytes | None = None
    # A KV connector's parameters (vLLM's kv_transfer_params): `do_remote_decode`
    # keeps the prompt's KV for a decode engine to pull; `do_remote_prefill`
    # with the producer's `remote_*` fields pulls it instead of computing it.
    kv_transfer_params: dict[str, Any] | None = None


class Abort(msgspec.Struct, tag="abort"):
    """Stop these requests now and free their blocks."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Call one allow-listed engine method between steps."""

    call_id: int
    method: str
    args: list[object] = msgspec.field(default_factory=list)
    kwargs: dict[str, object] = msgspec.field(default_factory=dict)


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """A frontend is alive."""

    client_id: str


FrontendMessage = Hello | AddRequest | Abort | UtilityCall | Heartbeat


# ----------------------------------------------------------------------------
# engine → frontend
# ----------------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready"):
    """The engine's answer to Hello: what it serves."""

    engine_id: str
    protocol_version: int
    model_name: str
    model_path: str
    tokenizer_path: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    eos_token_ids: list[int]
    supported_tasks: list[str]  # "generate" and/or "embed"
    hidden_size: int = 0  # the length of a pooled vector
    enable_lora: bool = False
    loras: list[LoRARequest] = msgspec.field(default_factory=list)  # registered now
    error: str | None = None


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs of one position: the chosen token first, then the top-N.

    token_ids[0] / logprobs[0] / ranks[0] belong to the token that was chosen
    (sampled, or the prompt token); the rest are the top-N in order.
    `requested` holds the log-probabilities of the request's
    SamplingParams.logprob_token_ids, in that order, at a sampled position
    (None elsewhere: one byte on the wire).
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int
    requested: list[float] | None = None


class RequestTimings(msgspec.Struct, array_like=True):
    """Where a finished request spent its time in the engine (seconds)."""

    queue_s: float  # queued until first scheduled
    prefill_s: float  # first scheduled until its first token
    decode_s: float  # first token until finished


class RequestDelta(msgspec.Struct, omit_defaults=True, array_like=True):
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it
    new_logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # Why the engine refused or dropped the request, for errors a client may
    # retry: "overloaded" (queue full), "sleeping", "queue_timeout".
    error_kind: str | None = None
    # A pooling request's result: little-endian float32 values.
    pooled: bytes | None = None
    timings: RequestTimings | None = None  # on the last delta of a finished request
    # On the last delta: (weight version, first, end) over the output tokens.
    weight_versions: list[tuple[int | str, int, int]] | None = None
    # On the last delta, with a KV connector: what the next engine needs to
    # pull this request's KV (a producer), or how its KV came (a consumer:
    # "kv_transfer" is "transferred" or "recomputed").
    kv_transfer_params: dict[str, Any] | None = None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """Engine load and cache figures, sent with outputs for metrics/routing."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    is_sleeping: bool = False
    # Prompt positions run through the model (prefix-cache and transferred
    # tokens are not), and the KV connector's counters (core/kv_connector.py).
    prompt_tokens_computed: int = 0
    kv_transfers: int = 0  # requests whose KV was pulled from a producer
    kv_transfer_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_recomputed: int = 0  # remote-prefill requests computed here instead
    kv_served: int = 0  # requests whose KV a consumer pulled from here
    kv_expired: int = 0  # held KV freed unread after the timeout
    # Speculative decoding (--speculative-config): request-steps that verified
    # drafts, draft tokens, accepted ones, and accepted ones by draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)


class Outputs(msgspec.Struct, tag="outputs"):
    """One step's deltas for one client, plus the engine's stats."""

    deltas: list[RequestDelta]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0


class UtilityResult(msgspec.Struct, tag="utility_result", omit_defaults=True):
    """The answer to a UtilityCall."""

    call_id: int
    result: object = None
    error: str | None = None
    # "unknown_method" | "invalid" (bad arguments) | "busy" (refused while
    # requests are in flight) | "failed" (the method raised)
    error_kind: str | None = None


class EngineDead(msgspec.Struct, tag="engine_dead"):
    """The engine is going away; in-flight requests are lost."""

    reason: str


EngineMessage = Ready | Outputs | UtilityResult | EngineDead


def make_frontend_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    """Encoder for what a frontend sends, decoder for what it receives."""
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineMessage)


def make_engine_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    """Encoder for what an engine sends, decoder for what it receives."""
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FrontendMessage)
