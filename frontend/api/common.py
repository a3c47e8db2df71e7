"""Helpers shared by the generation routes: params, SSE, disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from pagoda.frontend.api.errors import APIError, error_json
from pagoda.frontend.api.openai_models import ChatCompletionRequest, CompletionRequest
from pagoda.frontend.api.structured_outputs import constraint_from
from pagoda.frontend.async_llm import AsyncLLM, EngineRequestError, EngineUnavailableError
from pagoda.frontend.engine_client import EngineDeadError
from pagoda.frontend.outputs import CompletionOutput
from pagoda.protocol.messages import LoRARequest
from pagoda.protocol.sampling_params import SamplingParams, SamplingParamsError

T = TypeVar("T")
logger = logging.getLogger(__name__)

# What a 503 tells clients to wait before retrying (the openai clients honour it).
RETRY_AFTER_S = 1


def unavailable(message: str) -> APIError:
    """A 503 with Retry-After: the server cannot take the request now, later it may."""
    return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def check_model(engine: AsyncLLM, served_names: list[str], model: str | None) -> str:
    """The served name (or LoRA adapter name) a request asks for; 404 for any other."""
    if model is None or model in served_names:
        return model or served_names[0]
    if model in engine.loras:
        return model
    raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


async def refresh_loras(engine: AsyncLLM, served_names: list[str], model: str | None) -> None:
    """Ask the engine for its adapters when a request names a model this server does not
    know: another API server (or a request by path) may have loaded it."""
    if (
        engine.ready.enable_lora
        and model is not None
        and model not in served_names
        and model not in engine.loras
    ):
        await engine.list_loras()


def lora_for(engine: AsyncLLM, model: str) -> LoRARequest | None:
    """The adapter a checked model name picks (None: the base model)."""
    return engine.loras.get(model)


def sampling_params_from(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """OpenAI request fields → SamplingParams (validated)."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    logit_bias: dict[int, float] | None = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from None
    params = SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        logit_bias=logit_bias,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=constraint_from(
            req.response_format, req.structured_outputs, req.model_extra
        ),
    )
    return params


def as_api_error(exc: BaseException) -> APIError:
    """Map what generation can raise onto the API's error shape."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamsError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, EngineUnavailableError):
        return unavailable(str(exc)[:500])
    if isinstance(exc, EngineRequestError | ValueError):
        return APIError(400, str(exc)[:500])
    if isinstance(exc, EngineDeadError):
        return unavailable(f"the engine core is not available: {exc}")
    logger.error("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the HTTP client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it (aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise APIError(499, "client disconnected")
    return task.result()


def usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


def accumulate(target: CompletionOutput, delta: CompletionOutput) -> None:
    """Fold one streamed delta of a sample into its running total."""
    target.text += delta.text
    target.token_ids += delta.token_ids
    if delta.logprobs is not None:
        target.logprobs = (target.logprobs or []) + delta.logprobs
    target.cumulative_logprob = delta.cumulative_logprob
    target.finish_reason = delta.finish_reason
    target.stop_reason = delta.stop_reason
    if delta.weight_versions is not None:
        target.weight_versions = delta.weight_versions
    if delta.kv_transfer_params is not None:
        target.kv_transfer_params = delta.kv_transfer_params


# json.dumps(..., ensure_ascii=False) builds a new encoder per call; streamed
# events are encoded once per token, so they share this one (same output).
_EVENT_ENCODER = json.JSONEncoder(ensure_ascii=False)


def event_json(data: Any) -> str:
    """A streamed event's JSON text, non-ASCII kept as is."""
    return _EVENT_ENCODER.encode(data)


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else event_json(data)
    return f"data: {payload}\n\n"


async def sse_with_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Stream events; an error after the start becomes an error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - reported to the client in-band
        yield sse(error_json(as_api_error(e)))
    yield "data: [DONE]\n\n"


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive: (stream index, item)."""
    if len(streams) == 1:
        # One prompt, the usual case: no relay task and queue hop per token.
        stream = streams[0]
        try:
            async for item in stream:
                yield 0, item
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def with_weight_versions(output: Any) -> dict[str, Any]:
    """A finished choice's `weight_versions` field, when weight updates made it
    matter (after POST /update_weights); nothing otherwise."""
    versions = getattr(output, "weight_versions", None)
    return {"weight_versions": versions} if versions else {}


def kv_transfer_params_of(req: Any) -> dict[str, Any] | None:
    """A request body's `kv_transfer_params` (vLLM's field for KV connectors):
    an object or 400; the engine checks it suits its connector."""
    params = getattr(req, "kv_transfer_params", None)
    if params is None:
        params = (getattr(req, "model_extra", None) or {}).get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise APIError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    return params


def kv_transfer_params_field(outputs: Any) -> dict[str, Any]:
    """A response's top-level `kv_transfer_params` (vLLM's): the first finished
    sample's, or null."""
    for out in outputs:
        if getattr(out, "kv_transfer_params", None) is not None:
            return {"kv_transfer_params": out.kv_transfer_params}
    return {"kv_transfer_params": None}


def cache_salt_of(req: Any) -> str | None:
    """A request body's `cache_salt` (vLLM's extra field): a non-empty string or 400."""
    salt = (getattr(req, "model_extra", None) or {}).get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > 1024:
        raise APIError(
            400, "cache_salt must be a non-empty string of at most 1024 characters", "cache_salt"
        )
    return salt
