"""vLLM-shaped results handed to SDK users and to the HTTP routes.

Logprobs follow vLLM: one dict per position mapping token id → Logprob
(logprob, rank, decoded_token), holding the chosen token and the top-N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One candidate token's log-probability at one position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample (choice) of a request.

    In streaming (delta) mode `text` and `token_ids` hold only what is new
    since the previous output; otherwise they are cumulative.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # stop token id or stop string
    # On a finished sample: which weights made which output tokens,
    # [{"version", "start", "end"}] (end exclusive), after weight updates.
    weight_versions: list[dict[str, Any]] | None = None
    # On a finished sample, with a KV connector: what a decode engine needs to
    # pull its KV (a prefill with do_remote_decode), or how its KV came.
    kv_transfer_params: dict[str, Any] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- pooling


@dataclass
class PoolingOutput:
    """The pooled vector of one prompt (vLLM's PoolingOutput, as a list)."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """One pooling request's result: `outputs.data` is the vector."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class EmbeddingOutput:
    """One embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result per prompt: `outputs.embedding`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    """The score of one pair (cosine similarity of the two embeddings)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """LLM.score's result per pair: `outputs.score`; token ids of both texts."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
