"""vLLM's tokens-in / tokens-out bodies (pydantic) and their SamplingParams.

`GenerateRequest` is what POST /inference/v1/generate takes and what the
render routes answer: prompt token ids plus vLLM's SamplingParams as JSON.
Unlike the OpenAI bodies, unknown names are a 400 here, in the request and
in its `sampling_params` (a misspelt `max_token` must not silently mean "the
rest of the context"). vLLM's own names are known: the ones Pagoda honours
are fields, the ones that only tune vLLM's Python objects are accepted and
ignored, and the ones Pagoda cannot honour are accepted only at their
neutral value (a 400 names them otherwise).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from pagoda.frontend.api.openai_models import StreamOptions
from pagoda.frontend.api.structured_outputs import StructuredOutputsRequest, constraint_from
from pagoda.protocol.sampling_params import SamplingParams, StructuredOutputsParams

_INT64 = 2**63 - 1
# A prompt longer than any context is refused by length later; this only
# bounds what is parsed (the body limit bounds it too).
MAX_TOKEN_IDS = 1_000_000
MAX_REQUEST_ID_CHARS = 256
MAX_ABORT_IDS = 4096

# vLLM SamplingParams fields that shape vLLM's Python outputs or scheduling
# hints only: accepted, no effect on what Pagoda returns.
_IGNORED = frozenset(
    {"output_kind", "flat_logprobs", "skip_clone", "stream_interval", "extra_args"}
)
# vLLM SamplingParams fields Pagoda does not implement: fine at these values only.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
    "thinking_token_budget": (None, -1),
    "repetition_detection": (None,),
    "skip_reading_prefix_cache": (None, False),
    "routed_experts_prompt_start": (0,),
    "trace_decode_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None, []),
}


class GenerateSamplingParams(BaseModel):
    """vLLM's SamplingParams as JSON. Ranges are checked by `SamplingParams.validate`,
    which names the field; only what could not even be carried is bounded here."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, le=_INT64)
    # These tokens' full-vocabulary logprobs at each sampled position, beside the top ones.
    logprob_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1, le=_INT64)
    min_p: float = 0.0
    seed: int | None = Field(None, ge=-_INT64 - 1, le=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    # None: the rest of the context (max_model_len - prompt length), as vLLM's route does.
    max_tokens: int | None = Field(None, le=_INT64)
    min_tokens: int = Field(0, ge=0, le=_INT64)
    logprobs: int | None = Field(None, le=_INT64)
    prompt_logprobs: int | None = Field(None, le=_INT64)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsRequest | None = None
    logit_bias: dict[int, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_only_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kept = {}
        for name, value in data.items():
            if name in _IGNORED:
                continue
            if name in _NEUTRAL:
                if not any(value == v and type(value) is type(v) for v in _NEUTRAL[name]):
                    raise ValueError(f"{name} is not supported")
                continue
            kept[name] = value
        return kept

    def to_sampling_params(self) -> SamplingParams:
        """Pagoda's SamplingParams (not yet validated: the processor does that)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        constraint = None
        if self.structured_outputs is not None:
            constraint = constraint_from(None, self.structured_outputs, None)
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=self.logit_bias,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=constraint,
            logprob_token_ids=self.logprob_token_ids,
        )


def sampling_params_json(params: SamplingParams) -> dict[str, Any]:
    """`params` in vLLM's names, every field GenerateSamplingParams takes, as a render
    answers them (so that POST /inference/v1/generate takes them back unchanged)."""
    body = {
        name: getattr(params, name)
        for name in GenerateSamplingParams.model_fields
        if name not in ("structured_outputs", "detokenize")
    }
    body["stop_token_ids"] = list(params.stop_token_ids)
    body["detokenize"] = True
    body["structured_outputs"] = _constraint_json(params.structured_outputs)
    return body


def _constraint_json(constraint: StructuredOutputsParams | None) -> dict[str, Any] | None:
    """A constraint in vLLM's `structured_outputs` shape (the JSON schema as text)."""
    if constraint is None:
        return None
    if constraint.json_object:
        return {"json_object": True}
    return {
        kind: getattr(constraint, kind)
        for kind in ("json", "regex", "choice", "grammar")
        if getattr(constraint, kind) is not None
    }


class GenerateRequest(BaseModel):
    """POST /inference/v1/generate: vLLM's GenerateRequest."""

    model_config = ConfigDict(extra="forbid")

    # The server's id is "generate-tokens-" + X-Request-Id, else this, else a new one.
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)
    token_ids: list[StrictInt] = Field(..., min_length=1, max_length=MAX_TOKEN_IDS)
    sampling_params: GenerateSamplingParams
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Accepted; the prefix cache is not salted yet.
    cache_salt: str | None = Field(None, min_length=1)
    priority: int = Field(0, ge=-_INT64 - 1, le=_INT64)
    # Accepted; no KV transfer is configured, so the answer's is null.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's multimodal features: text-only models here, so none.
    features: None = None
    # The rendered text a render route adds; not read.
    prompt: str | None = None
    # Other fields of vLLM's render output, not read.
    assistant_tokens_mask: list[int] | None = None
    token_offsets: list[tuple[int, int]] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class AbortRequests(BaseModel):
    """POST /inference/v1/abort_requests: the server's request ids (generate-tokens-…)."""

    model_config = ConfigDict(extra="forbid")

    request_ids: list[str] = Field(..., max_length=MAX_ABORT_IDS)
