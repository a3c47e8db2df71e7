"""POST /v1/chat/completions: messages through the chat template → a reply."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.frontend.api.common import (
    accumulate,
    cache_salt_of,
    check_model,
    kv_transfer_params_field,
    kv_transfer_params_of,
    lora_for,
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
from pagoda.frontend.api.openai_models import ChatCompletionRequest
from pagoda.frontend.api.tool_calls import (
    ToolCallStream,
    ToolRequest,
    check_tools,
    reply_message,
)
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.chat_render import ChatMessageError, render_chat
from pagoda.frontend.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagoda.frontend.tokenizer import ChatTemplateError
from pagoda.protocol.sampling_params import MAX_LOGPROBS, SamplingParams


def chat_logprobs(
    engine: AsyncLLM, token_ids: list[int], logprobs: list[PositionLogprobs], num_top: int
) -> list[dict[str, Any]]:
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=True):
        chosen = position.get(token_id)
        text = engine.tokenizer.token_text(token_id)
        top: list[dict[str, Any]] = []
        for tid, lp in sorted(position.items(), key=lambda kv: kv[1].rank or 0):
            if lp.rank is not None and 1 <= lp.rank <= num_top and len(top) < num_top:
                t = lp.decoded_token or engine.tokenizer.token_text(tid)
                top.append({"token": t, "logprob": lp.logprob, "bytes": list(t.encode())})
        content.append(
            {
                "token": text,
                "logprob": chosen.logprob if chosen else float("-inf"),
                "bytes": list(text.encode()),
                "top_logprobs": top,
            }
        )
    return content


class ChatServer:
    """Handles /v1/chat/completions for one AsyncLLM."""

    def __init__(
        self, engine: AsyncLLM, served_names: list[str], tool_parser: str | None = None
    ) -> None:
        self.engine = engine
        self.served_names = served_names
        self.tool_parser = tool_parser

    def tool_request(self, req: ChatCompletionRequest) -> ToolRequest:
        return check_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)

    def render(self, req: ChatCompletionRequest) -> str:
        """The prompt text, rendered as `LLM.chat` renders it (frontend/chat_render.py)."""
        self.tool_request(req)
        try:
            return render_chat(
                self.engine.tokenizer,
                [msg.model_dump() for msg in req.messages],
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
            )
        except ChatMessageError as e:
            raise APIError(400, str(e), e.param) from None
        except ChatTemplateError as e:
            raise APIError(400, str(e)[:500], "messages") from None

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Any:
        await refresh_loras(self.engine, self.served_names, req.model)
        model = check_model(self.engine, self.served_names, req.model)
        params, tools, prompt, prompt_ids = self.prepare(req)
        request_id = new_id("chatcmpl")
        created = now()
        stream = self.engine.generate_tokens(
            prompt,
            prompt_ids,
            params,
            request_id,
            priority=req.priority,
            lora_request=lora_for(self.engine, model),
            cache_salt=cache_salt_of(req),
            kv_transfer_params=kv_transfer_params_of(req),
        )
        if req.stream:
            # Validation errors must be a 400, not an in-stream error: start it first.
            first = await anext(stream)
            events = self._stream(
                req, params, tools, len(prompt_ids), first, stream, request_id, created, model
            )
            return StreamingResponse(sse_with_errors(events), media_type="text/event-stream")
        final = await unless_disconnected(raw, _last(stream))
        return JSONResponse(
            self._response(req, tools, len(prompt_ids), final, request_id, created, model)
        )

    def prepare(
        self, req: ChatCompletionRequest
    ) -> tuple[SamplingParams, ToolRequest, str, list[int]]:
        """Checked sampling params, tool request, rendered prompt and its token ids."""
        top = req.top_logprobs
        if top is not None and top > MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be at most {MAX_LOGPROBS}", "top_logprobs")
        if top is not None and top > 0 and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (top or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = sampling_params_from(req, max_tokens, logprobs)
        tools = self.tool_request(req)
        forced = tools.constraint()
        if forced is not None:
            if params.structured_outputs is not None:
                raise APIError(
                    400,
                    "a required or named tool_choice cannot be combined with another "
                    "output constraint",
                    "tool_choice",
                )
            params = msgspec.structs.replace(params, structured_outputs=forced)
        prompt = self.render(req)
        prompt_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
        return params, tools, prompt, prompt_ids

    def _response(
        self,
        req: ChatCompletionRequest,
        tools: ToolRequest,
        num_prompt: int,
        outputs: list[CompletionOutput],
        request_id: str,
        created: int,
        model: str,
    ) -> dict[str, Any]:
        choices = []
        for out in outputs:
            logprobs = None
            if req.logprobs and out.logprobs is not None:
                logprobs = {
                    "content": chat_logprobs(
                        self.engine, out.token_ids, out.logprobs, req.top_logprobs or 0
                    )
                }
            message = reply_message(tools, self.tool_parser, out.text)
            finish = out.finish_reason
            if message["tool_calls"] and finish == "stop":
                finish = "tool_calls"
            choices.append(
                {
                    "index": out.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": out.stop_reason,
                    **with_weight_versions(out),
                }
            )
        num_completion = sum(len(o.token_ids) for o in outputs)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(num_prompt, num_completion),
            **kv_transfer_params_field(outputs),
        }

    async def _stream(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        tools: ToolRequest,
        num_prompt: int,
        first: RequestOutput,
        rest: AsyncIterator[RequestOutput],
        request_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = dict(base, choices=choices, **extra)
            if include_usage and "usage" not in extra:
                body["usage"] = None
            return sse(body)

        for i in range(params.n):
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        num_completion = 0
        streams = [ToolCallStream(tools, self.tool_parser) for _ in range(params.n)]

        async def all_outputs() -> AsyncIterator[RequestOutput]:
            yield first
            async for out in rest:
                yield out

        async for out in all_outputs():
            for o in out.outputs:
                num_completion += len(o.token_ids)
                logprobs = None
                if req.logprobs and o.logprobs is not None:
                    logprobs = {
                        "content": chat_logprobs(
                            self.engine, o.token_ids, o.logprobs, req.top_logprobs or 0
                        )
                    }
                tool_stream = streams[o.index]
                delta = tool_stream.delta(o.text, o.finish_reason is not None)
                if not delta and o.finish_reason is None and tools.mode == "none":
                    delta = {"content": ""}
                extra = {}
                if o.kv_transfer_params is not None:
                    extra["kv_transfer_params"] = o.kv_transfer_params
                yield chunk(
                    [
                        {
                            "index": o.index,
                            "delta": delta,
                            "logprobs": logprobs,
                            "finish_reason": tool_stream.finish_reason(o.finish_reason),
                            "stop_reason": o.stop_reason,
                            **with_weight_versions(o),
                        }
                    ],
                    **extra,
                )
        if include_usage:
            yield chunk(
                [],
                usage=usage(num_prompt, num_completion),
            )


async def _last(stream: AsyncIterator[RequestOutput]) -> list[CompletionOutput]:
    """Accumulate a delta stream into the final outputs."""
    acc: dict[int, CompletionOutput] = {}
    async for out in stream:
        for o in out.outputs:
            accumulate(acc.setdefault(o.index, CompletionOutput(o.index, "", [])), o)
    return [acc[i] for i in sorted(acc)]
