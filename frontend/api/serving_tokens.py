"""Tokens in, tokens out: vLLM's /inference/v1 routes, for RL trainers and routers.

    POST /inference/v1/generate        {token_ids, sampling_params, ...} → token ids
    POST /inference/v1/abort_requests  {"request_ids": [...]} → 200, empty

A generate request is a completion on token ids: the same processor checks,
engine request and output path as /v1/completions (`AsyncLLM.generate_tokens`),
answered in vLLM's GenerateResponse shape. Its id is "generate-tokens-"
followed by the X-Request-Id header, else the body's `request_id`, else a new
one; that is the id /inference/v1/abort_requests takes (it aborts the
requests of the API server it reaches). Logprobs name tokens as "token_id:N"
and carry no bytes, so no tokenizer is needed to answer.

With --tokens-only (`TokensServer.tokens_only`) the API server has no
tokenizer at all: these routes serve, the text routes answer 404 saying so,
and stop strings are refused (stop_token_ids work).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.frontend.api.common import (
    check_model,
    kv_transfer_params_field,
    lora_for,
    now,
    refresh_loras,
    sse,
    sse_with_errors,
    unless_disconnected,
    usage,
    with_weight_versions,
)
from pagoda.frontend.api.errors import APIError, error_response
from pagoda.frontend.api.inflight import InFlight
from pagoda.frontend.api.openai_models import StreamOptions
from pagoda.frontend.api.serving_pooling import POOLING_PATHS
from pagoda.frontend.api.serving_refusals import GENERATION_PATHS
from pagoda.frontend.api.tokens_models import (
    AbortRequests,
    GenerateRequest,
    sampling_params_json,
)
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.outputs import PositionLogprobs, RequestOutput
from pagoda.protocol.sampling_params import SamplingParams

REQUEST_ID_PREFIX = "generate-tokens-"
# JSON has no -Infinity: a token the model rules out reads as vLLM writes it.
MIN_LOGPROB = -9999.0
# Routes that need a tokenizer: with --tokens-only they answer 404 saying why.
TEXT_PATHS = (
    *(path for path in GENERATION_PATHS if not path.startswith("/inference/")),
    *POOLING_PATHS,
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/invocations",
)


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def token_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], num_top: int
) -> dict[str, Any]:
    """vLLM's generate logprobs: chat's shape with "token_id:N" for the tokens."""
    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = position.get(token_id)
        ranked = sorted(
            (item for item in position.items() if item[1].rank is not None),
            key=lambda item: item[1].rank or 0,
        )
        top = [
            {"token": f"token_id:{tid}", "logprob": _logprob(lp.logprob), "bytes": None}
            for tid, lp in ranked
            if lp.rank is not None and 1 <= lp.rank <= num_top
        ][:num_top]
        # logprob_token_ids' values (no rank), after the top ones.
        top += [
            {"token": f"token_id:{tid}", "logprob": _logprob(lp.logprob), "bytes": None}
            for tid, lp in position.items()
            if lp.rank is None
        ]
        content.append(
            {
                "token": f"token_id:{token_id}",
                "logprob": _logprob(chosen.logprob) if chosen else MIN_LOGPROB,
                "bytes": None,
                "top_logprobs": top,
            }
        )
    return {"content": content}


def prompt_logprobs_json(
    positions: list[PositionLogprobs | None] | None,
) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: per prompt position None or {token id: Logprob}."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            str(tid): {
                "logprob": _logprob(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for tid, lp in position.items()
        }
        for position in positions
    ]


def render_body(
    request_id: str,
    prompt: str,
    token_ids: list[int],
    params: SamplingParams,
    model: str | None,
    stream: bool,
    stream_options: StreamOptions | None,
    cache_salt: Any,
    priority: int,
) -> dict[str, Any]:
    """A render route's answer: a GenerateRequest (params resolved, max_tokens
    included) plus the rendered `prompt` text; POST it to /inference/v1/generate."""
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "features": None,
        "sampling_params": sampling_params_json(params),
        "model": model,
        "stream": stream,
        "stream_options": stream_options.model_dump() if stream and stream_options else None,
        "cache_salt": cache_salt if isinstance(cache_salt, str) and cache_salt else None,
        "priority": priority,
        "kv_transfer_params": None,
        "prompt": prompt,
    }


class TokensServer:
    """Handles the /inference/v1 routes for one AsyncLLM."""

    def __init__(self, engine: AsyncLLM, served_names: list[str], tokens_only: bool) -> None:
        self.engine = engine
        self.served_names = served_names
        self.tokens_only = tokens_only

    async def generate(self, req: GenerateRequest, raw: Request) -> Any:
        await refresh_loras(self.engine, self.served_names, req.model)
        model = check_model(self.engine, self.served_names, req.model)
        if req.stream_options is not None and not req.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true", "stream_options"
            )
        params = req.sampling_params.to_sampling_params()
        prompt = self.engine.processor.process_prompt(req.token_ids)  # ids in the vocabulary
        base_id = raw.headers.get("x-request-id") or req.request_id or uuid.uuid4().hex
        request_id = REQUEST_ID_PREFIX + base_id[:256]
        stream = self.engine.generate_tokens(
            None,
            prompt.prompt_token_ids,
            params,
            request_id,
            output_kind="delta" if req.stream else "final",
            priority=req.priority,
            lora_request=lora_for(self.engine, model),
            detokenize=req.sampling_params.detokenize and not self.tokens_only,
            cache_salt=req.cache_salt,
            kv_transfer_params=req.kv_transfer_params,
        )
        if req.stream:
            # The first output (or the refusal) comes before any answer: a bad
            # request is a status, never an error inside a 200 stream.
            first = await anext(stream)
            events = self._stream(req, params, first, stream, request_id)
            return StreamingResponse(sse_with_errors(events), media_type="text/event-stream")
        final = await unless_disconnected(raw, _last(stream))
        return JSONResponse(self._response(params, final, request_id, model))

    def _response(
        self, params: SamplingParams, final: RequestOutput, request_id: str, model: str
    ) -> dict[str, Any]:
        choices = []
        for out in final.outputs:
            logprobs = None
            if params.logprobs is not None and out.logprobs is not None:
                logprobs = token_logprobs(out.token_ids, out.logprobs, params.logprobs)
            choices.append(
                {
                    "index": out.index,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason or "stop",
                    "logprobs": logprobs,
                    **with_weight_versions(out),
                }
            )
        num_completion = sum(len(o.token_ids) for o in final.outputs)
        return {
            "request_id": request_id,
            "model": model,
            "created": now(),
            "choices": choices,
            "prompt_logprobs": prompt_logprobs_json(final.prompt_logprobs),
            **kv_transfer_params_field(final.outputs),
            "usage": usage(len(final.prompt_token_ids), num_completion),
        }

    async def _stream(
        self,
        req: GenerateRequest,
        params: SamplingParams,
        first: RequestOutput,
        rest: AsyncIterator[RequestOutput],
        request_id: str,
    ) -> AsyncIterator[str]:
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        num_prompt = len(first.prompt_token_ids)
        num_generated = [0] * params.n
        async for out in _prepend(first, rest):
            for o in out.outputs:
                num_generated[o.index] += len(o.token_ids)
                if not o.token_ids and o.finish_reason is None:
                    continue
                logprobs = None
                if params.logprobs is not None and o.logprobs is not None:
                    logprobs = token_logprobs(o.token_ids, o.logprobs, params.logprobs)
                choice = {
                    "index": o.index,
                    "token_ids": o.token_ids,
                    "finish_reason": o.finish_reason,
                    "logprobs": logprobs,
                    **with_weight_versions(o),
                }
                chunk_usage = usage(num_prompt, num_generated[o.index]) if continuous else None
                body = {"request_id": request_id, "choices": [choice], "usage": chunk_usage}
                if o.kv_transfer_params is not None:
                    body["kv_transfer_params"] = o.kv_transfer_params
                yield sse(body)
        if include_usage:
            total = usage(num_prompt, sum(num_generated))
            yield sse({"request_id": request_id, "choices": [], "usage": total})

    async def abort(self, request_ids: list[str]) -> None:
        """Abort the requests this API server runs (each ends with finish_reason
        "abort"); other ids are ignored."""
        for request_id in dict.fromkeys(request_ids):
            await self.engine.abort(request_id)


async def _prepend(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The last output of a stream in "final" mode (its only one)."""
    final = None
    async for out in outputs:
        final = out
    if final is None:
        raise APIError(500, "the request ended without an output")
    return final


def build_router(server: TokensServer, in_flight: InFlight) -> APIRouter:
    """The /inference/v1 routes; with --tokens-only also the text routes' 404s."""
    router = APIRouter()

    @router.post("/inference/v1/generate")
    async def generate(body: GenerateRequest, request: Request) -> Any:
        return await in_flight.counted(lambda: server.generate(body, request))

    @router.post("/inference/v1/abort_requests")
    async def abort_requests(body: AbortRequests) -> Response:
        """Abort these requests (ids as generate answered them); unknown ids are ignored."""
        await server.abort(body.request_ids)
        return Response(status_code=200)

    if server.tokens_only:
        refuse = _refusal(
            APIError(
                404,
                "this server runs with --tokens-only: it has no tokenizer and serves "
                "token ids only (POST /inference/v1/generate)",
                code="tokens_only",
            )
        )
        for path in TEXT_PATHS:
            router.add_api_route(path, refuse, methods=["GET", "POST"], include_in_schema=False)
    return router


def _refusal(error: APIError) -> Callable[[Request], Awaitable[Response]]:
    async def refuse(request: Request) -> Response:
        return error_response(request, error)

    return refuse
