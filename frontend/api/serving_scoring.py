"""Generative scoring: how likely each label token is to come next after query + item.

    POST /generative_scoring      (vLLM's path; also /v1/generative_scoring)
    {"query": "Is this review positive? ", "items": ["Great food.", "Cold soup."],
     "label_token_ids": [9454, 2822]}
    → {"data": [{"index": 0, "object": "score", "score": 0.93,
                 "label_probs": {"9454": 0.93, "2822": 0.07}}, ...], "usage": {...}}

Each item is one engine request whose prompt is query + item (item + query
with `item_first`); the query is tokenized with `add_special_tokens`, the
items without. The request samples one greedy token with
`logprob_token_ids` set to the labels, so the engine returns the labels'
full-vocabulary log-probabilities at the position after the prompt (the raw
distribution, as the logprobs of every route). `score` is the first label's
probability: softmax over the labels alone with `apply_softmax` (the
default), else exp of its full-vocabulary log-probability; `label_probs`
gives every label's (a repeated label id counts once).

All items go to the engine at once. The first one scheduled puts the
query's full KV blocks in the prefix cache as they are allocated, and the
others take them over, in the same step or later: the query is computed
once, and `usage.prompt_tokens_details.cached_tokens` counts the prompt
tokens taken from the cache. With `item_first` the prompts share no prefix.

A prompt that leaves no position for the next token (max_model_len tokens
or more) is refused with a 400 naming the item; vLLM instead keeps the
first max_model_len - 1 tokens, which scores a prompt without its end.
"""

from __future__ import annotations

import math
from typing import Any, cast

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from pagoda.frontend.api.common import (
    check_model,
    lora_for,
    merge_streams,
    new_id,
    now,
    refresh_loras,
    unavailable,
    unless_disconnected,
)
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.outputs import RequestOutput
from pagoda.frontend.processor import check_priority
from pagoda.protocol.sampling_params import (
    MAX_LOGPROB_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)

SCORING_PATHS = ("/generative_scoring", "/v1/generative_scoring")
MAX_ITEMS = 2048


class GenerativeScoringRequest(BaseModel):
    """vLLM's generative scoring body."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str | list[StrictInt]
    items: list[str] | list[list[StrictInt]]
    label_token_ids: list[StrictInt]
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = Field(None, max_length=256)

    # Checked before pydantic's union does, whose errors name its branches.
    @field_validator("query", mode="before")
    @classmethod
    def _query_kind(cls, query: Any) -> Any:
        if not (isinstance(query, str) or _is_token_ids(query)):
            raise ValueError("query must be a string or a list of token ids")
        return query

    @field_validator("items", mode="before")
    @classmethod
    def _items_kind(cls, items: Any) -> Any:
        if not isinstance(items, list):
            raise ValueError("items must be a list of strings or of token-id lists")
        for i, item in enumerate(items):
            if not (isinstance(item, str) or _is_token_ids(item)):
                raise ValueError(f"items[{i}] must be a string or a list of token ids")
        num_texts = sum(isinstance(item, str) for item in items)
        if 0 < num_texts < len(items):
            raise ValueError("items must be all strings or all token-id lists, not a mix")
        return items


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def label_probabilities(logprobs: dict[int, float], apply_softmax: bool) -> dict[int, float]:
    """Each label's probability: softmax over the labels alone, or exp of its logprob.

    A softmax over the labels' log-probabilities equals one over their logits:
    the two differ by the same constant (the log of the partition function).
    """
    if not apply_softmax:
        return {t: math.exp(lp) for t, lp in logprobs.items()}
    top = max(logprobs.values())
    weights = {t: math.exp(lp - top) for t, lp in logprobs.items()}
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


class ScoringServer:
    """Runs generative scoring requests on one AsyncLLM."""

    def __init__(self, engine: AsyncLLM, served: list[str]) -> None:
        self.engine = engine
        self.served = served

    async def score(self, req: GenerativeScoringRequest, raw: Request) -> dict[str, Any]:
        await refresh_loras(self.engine, self.served, req.model)
        model = check_model(self.engine, self.served, req.model)
        labels = self._labels(req.label_token_ids)
        prompts = self._prompts(req)
        try:
            check_priority(req.priority)
        except SamplingParamsError as e:
            raise APIError(400, str(e), e.param) from None
        # One greedy token: nothing is decoded after the prompt's last position.
        params = SamplingParams(temperature=0.0, max_tokens=1, logprob_token_ids=labels)
        prefix = "generative-scoring"
        request_id = f"{prefix}-{req.request_id}" if req.request_id else new_id(prefix)
        lora = lora_for(self.engine, model)
        streams = [
            self.engine.generate_tokens(
                None, ids, params, f"{request_id}-{i}", "final", req.priority, lora
            )
            for i, ids in enumerate(prompts)
        ]
        outputs = await unless_disconnected(raw, self._collect(streams))
        data = [self._result(i, out, labels, req.apply_softmax) for i, out in enumerate(outputs)]
        num_prompt = sum(len(ids) for ids in prompts)
        num_completion = sum(len(out.outputs[0].token_ids) for out in outputs)
        return {
            "id": request_id,
            "object": "list",
            "created": now(),
            "model": model,
            "data": data,
            "usage": {
                "prompt_tokens": num_prompt,
                "total_tokens": num_prompt + num_completion,
                "completion_tokens": num_completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(out.num_cached_tokens for out in outputs)
                },
            },
        }

    def _labels(self, label_token_ids: list[int]) -> list[int]:
        """The distinct label ids in their order; 400 unless each is in the vocabulary."""
        if not label_token_ids:
            raise APIError(
                400, "label_token_ids must hold at least one token id", "label_token_ids"
            )
        labels = list(dict.fromkeys(label_token_ids))
        if len(labels) > MAX_LOGPROB_TOKEN_IDS:
            raise APIError(
                400, f"at most {MAX_LOGPROB_TOKEN_IDS} label_token_ids", "label_token_ids"
            )
        vocab_size = self.engine.ready.vocab_size
        for token_id in labels:
            if not 0 <= token_id < vocab_size:
                raise APIError(
                    400,
                    f"label_token_ids: token id {token_id} is outside the vocabulary "
                    f"[0, {vocab_size})",
                    "label_token_ids",
                )
        return labels

    def _prompts(self, req: GenerativeScoringRequest) -> list[list[int]]:
        """Token ids of query + item (item + query) for every item, each checked."""
        if not req.items:
            raise APIError(400, "items must hold at least one item", "items")
        if len(req.items) > MAX_ITEMS:
            raise APIError(400, f"at most {MAX_ITEMS} items per request", "items")
        query = self._tokens(req.query, req.add_special_tokens, "query")
        max_model_len = self.engine.ready.max_model_len
        prompts = []
        items = cast("list[str | list[int]]", req.items)  # either kind: mypy joins them
        for i, item in enumerate(items):
            if not item:
                raise APIError(400, f"items[{i}] is empty", "items")
            ids = self._tokens(item, False, "items")
            prompt = ids + query if req.item_first else query + ids
            if len(prompt) >= max_model_len:
                raise APIError(
                    400,
                    f"This model's maximum context length is {max_model_len} tokens. "
                    f"However, the prompt of items[{i}] (query + item) has {len(prompt)} "
                    f"tokens; scoring reads the position after it, so at most "
                    f"{max_model_len - 1} fit. Please shorten the query or the item.",
                    "items",
                )
            prompts.append(prompt)
        return prompts

    def _tokens(self, value: str | list[int], add_special_tokens: bool, param: str) -> list[int]:
        try:
            ids = self.engine.processor.process_prompt(value, add_special_tokens).prompt_token_ids
        except SamplingParamsError as e:
            raise APIError(400, f"{param}: {e}", param) from None
        return list(ids)

    async def _collect(self, streams: list[Any]) -> list[RequestOutput]:
        """Each item's final output, in item order."""
        outputs: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge_streams(streams):
            outputs[i] = out
        if any(out is None or not out.outputs[0].logprobs for out in outputs):
            raise unavailable("the scoring request was aborted")
        return outputs  # type: ignore[return-value]

    @staticmethod
    def _result(
        index: int, out: RequestOutput, labels: list[int], apply_softmax: bool
    ) -> dict[str, Any]:
        position = (out.outputs[0].logprobs or [{}])[0]  # the labels are always in it
        probs = label_probabilities({t: position[t].logprob for t in labels}, apply_softmax)
        return {
            "index": index,
            "object": "score",
            "score": probs[labels[0]],
            "label_probs": {str(t): p for t, p in probs.items()},
        }


def build_router(engine: AsyncLLM, served: list[str], counted: Any) -> APIRouter:
    """The scoring routes; `counted` runs each call as one in-flight request."""
    router = APIRouter()
    server = ScoringServer(engine, served)

    @router.post("/generative_scoring")
    @router.post("/v1/generative_scoring")
    async def create_generative_scoring(body: GenerativeScoringRequest, request: Request) -> Any:
        return await counted(lambda: server.score(body, request))

    return router
