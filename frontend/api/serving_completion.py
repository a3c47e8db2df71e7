"""POST /v1/completions: prompts (text or token ids) → text, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.frontend.api.common import (
    accumulate,
    cache_salt_of,
    check_model,
    kv_transfer_params_field,
    kv_transfer_params_of,
    lora_for,
    merge_streams,
    new_id,
    now,
    refresh_loras,
    sampling_params_from,
    sse,
    sse_with_errors,
    unless_disconnected,
    usage,
    with_weight_versions,
)
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.openai_models import CompletionRequest
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagoda.frontend.processor import ProcessedPrompt
from pagoda.protocol.sampling_params import MAX_LOGPROBS, SamplingParams

T = TypeVar("T")


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in p):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


def completion_logprobs(
    engine: AsyncLLM,
    token_ids: list[int],
    logprobs: list[PositionLogprobs | None],
    num_top: int,
    text_offset: int,
) -> dict[str, Any]:
    """The legacy completions logprobs object."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, position in zip(token_ids, logprobs, strict=True):
        text = engine.tokenizer.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if position is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        chosen = position.get(token_id)
        token_logprobs.append(chosen.logprob if chosen else None)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)
        entries: dict[str, float] = {}
        for tid, lp in ranked:
            if tid == token_id or (lp.rank is not None and lp.rank <= num_top):
                entries.setdefault(lp.decoded_token or engine.tokenizer.token_text(tid), lp.logprob)
        top.append(entries)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


class CompletionServer:
    """Handles /v1/completions for one AsyncLLM."""

    def __init__(self, engine: AsyncLLM, served_names: list[str]) -> None:
        self.engine = engine
        self.served_names = served_names

    async def create(self, req: CompletionRequest, raw: Request) -> Any:
        await refresh_loras(self.engine, self.served_names, req.model)
        model = check_model(self.engine, self.served_names, req.model)
        params, prompts = self.prepare(req)
        kv_params = kv_transfer_params_of(req)
        request_id = new_id("cmpl")
        created = now()
        streams = [
            self.engine.generate_tokens(
                p.prompt,
                p.prompt_token_ids,
                params,
                f"{request_id}-{i}",
                priority=req.priority,
                lora_request=lora_for(self.engine, model),
                cache_salt=cache_salt_of(req),
                kv_transfer_params=kv_params,
            )
            for i, p in enumerate(prompts)
        ]
        if req.stream:
            # Refusals (503: asleep, overloaded) and engine errors must be a status,
            # not an in-stream error: wait for the first output before answering.
            merged = merge_streams(streams)
            first = await anext(merged)
            events = self._stream(
                req, params, prompts, _prepend(first, merged), request_id, created, model
            )
            return StreamingResponse(sse_with_errors(events), media_type="text/event-stream")
        finals, prompt_lps = await unless_disconnected(
            raw, self._collect(streams, len(prompts), params.n)
        )
        return JSONResponse(
            self._response(req, params, prompts, finals, prompt_lps, request_id, created, model)
        )

    def prepare(self, req: CompletionRequest) -> tuple[SamplingParams, list[ProcessedPrompt]]:
        """Checked sampling params and the processed prompts, every one validated."""
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if req.logprobs is not None and req.logprobs > MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be at most {MAX_LOGPROBS}", "logprobs")
        params = sampling_params_from(req, req.max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None:
            import msgspec

            params = msgspec.structs.replace(params, prompt_logprobs=req.logprobs)
        processor = self.engine.processor
        prompts = [processor.process_prompt(p, req.add_special_tokens) for p in _prompts(req)]
        kv_params = kv_transfer_params_of(req)
        if kv_params is not None and len(prompts) > 1:
            raise APIError(400, "kv_transfer_params apply to one prompt", "kv_transfer_params")
        for prompt in prompts:  # validate all before starting any
            processor.make_requests(
                "check", prompt, params, req.priority, kv_transfer_params=kv_params
            )
        return params, prompts

    async def _collect(
        self, streams: list[AsyncIterator[RequestOutput]], num_prompts: int, n: int
    ) -> tuple[list[list[CompletionOutput]], dict[int, Any]]:
        # Accumulate deltas per prompt and sample.
        acc: list[list[CompletionOutput]] = [
            [CompletionOutput(i, "", [], logprobs=None) for i in range(n)]
            for _ in range(num_prompts)
        ]
        prompt_lps: dict[int, Any] = {}
        async for prompt_idx, out in merge_streams(streams):
            if out.prompt_logprobs is not None:
                prompt_lps[prompt_idx] = out.prompt_logprobs
            for o in out.outputs:
                accumulate(acc[prompt_idx][o.index], o)
        return acc, prompt_lps

    def _response(
        self,
        req: CompletionRequest,
        params: SamplingParams,
        prompts: list[ProcessedPrompt],
        finals: list[list[CompletionOutput]],
        prompt_lps: dict[int, Any],
        request_id: str,
        created: int,
        model: str,
    ) -> dict[str, Any]:
        choices = []
        num_completion = 0
        for prompt_idx, (prompt, outputs) in enumerate(zip(prompts, finals, strict=True)):
            prompt_text = prompt.prompt or self.engine.tokenizer.decode(prompt.prompt_token_ids)
            for out in outputs:
                num_completion += len(out.token_ids)
                text = (prompt_text + out.text) if req.echo else out.text
                logprobs = None
                if req.logprobs is not None:
                    token_ids = list(out.token_ids)
                    positions: list[PositionLogprobs | None] = list(out.logprobs or [])
                    if req.echo:
                        echo_lps: list[PositionLogprobs | None] = prompt_lps.get(prompt_idx) or [
                            None
                        ] * len(prompt.prompt_token_ids)
                        token_ids = prompt.prompt_token_ids + token_ids
                        positions = list(echo_lps) + positions
                    logprobs = completion_logprobs(
                        self.engine, token_ids, positions, req.logprobs, 0
                    )
                choices.append(
                    {
                        "index": prompt_idx * params.n + out.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                        **with_weight_versions(out),
                    }
                )
        num_prompt = sum(len(p.prompt_token_ids) for p in prompts)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(num_prompt, num_completion),
            **kv_transfer_params_field(out for outputs in finals for out in outputs),
        }

    async def _stream(
        self,
        req: CompletionRequest,
        params: SamplingParams,
        prompts: list[ProcessedPrompt],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        request_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        num_completion = 0
        echoed: set[int] = set()
        offsets: dict[tuple[int, int], int] = {}
        async for prompt_idx, out in outputs:
            for o in out.outputs:
                index = prompt_idx * params.n + o.index
                text = o.text
                if req.echo and index not in echoed:
                    echoed.add(index)
                    prompt = prompts[prompt_idx]
                    text = (
                        prompt.prompt or self.engine.tokenizer.decode(prompt.prompt_token_ids)
                    ) + text
                num_completion += len(o.token_ids)
                logprobs = None
                if req.logprobs is not None and o.logprobs is not None:
                    key = (prompt_idx, o.index)
                    logprobs = completion_logprobs(
                        self.engine,
                        o.token_ids,
                        list(o.logprobs),
                        req.logprobs,
                        offsets.get(key, 0),
                    )
                    offsets[key] = offsets.get(key, 0) + len(o.text)
                chunk: dict[str, Any] = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": index,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": o.finish_reason,
                            "stop_reason": o.stop_reason,
                            **with_weight_versions(o),
                        }
                    ],
                }
                if include_usage:
                    chunk["usage"] = None
                if o.kv_transfer_params is not None:
                    chunk["kv_transfer_params"] = o.kv_transfer_params
                yield sse(chunk)
        if include_usage:
            num_prompt = sum(len(p.prompt_token_ids) for p in prompts)
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(num_prompt, num_completion),
                }
            )


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item
