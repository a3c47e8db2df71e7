"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

Messages (text, tool_use and tool_result blocks) and the system prompt are
mapped onto the chat template's roles; the reply comes back as Anthropic
content blocks, streamed with the full event sequence (message_start,
content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop). Errors use Anthropic's shape.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from frontend.api.common import as_api_error, check_model, unless_disconnected
from frontend.api.errors import APIError, anthropic_error_body
from frontend.async_llm import AsyncLLM
from frontend.outputs import RequestOutput
from frontend.tokenizer import ChatTemplateError
from protocol.sampling_params import SamplingParams

_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int = Field(..., ge=1)
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    parts = []
    for block in blocks:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}: only text blocks are allowed here", where)
        parts.append(block["text"])
    return "\n".join(parts)


def to_chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic messages → chat-template messages (tool use as tool calls / tool turns)."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        texts: list[str] = []
        tool_calls: list[dict[str, Any]] = []
        for block in msg.content:
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and msg.role == "assistant":
                tool_calls.append(
                    {
                        "id": str(block.get("id", "")),
                        "type": "function",
                        "function": {
                            "name": str(block.get("name", "")),
                            "arguments": json.dumps(block.get("input", {})),
                        },
                    }
                )
            elif kind == "tool_result" and msg.role == "user":
                content = block.get("content", "")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": _text_of(content, f"messages.{i}.content")
                        if isinstance(content, (str, list))
                        else str(content),
                    }
                )
            else:
                raise APIError(
                    400,
                    f"unsupported content block {kind!r} for role {msg.role}",
                    f"messages.{i}.content",
                )
        if texts or tool_calls:
            entry: dict[str, Any] = {"role": msg.role, "content": "\n".join(texts)}
            if tool_calls:
                entry["tool_calls"] = tool_calls
            out.append(entry)
    return out


def _tools_for_template(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {}),
            },
        }
        for t in tools
    ]


def build_router(engine: AsyncLLM, served: list[str]) -> APIRouter:
    router = APIRouter()
    tokenizer = engine.tokenizer

    def render(req: MessagesRequest | CountTokensRequest) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(
                to_chat_messages(req), tools=_tools_for_template(req.tools)
            )
        except ChatTemplateError as e:
            raise APIError(400, str(e)[:500], "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest) -> dict[str, int]:
        check_model(engine, served, req.model)
        return {"input_tokens": len(render(req))}

    @router.post("/v1/messages")
    async def messages(req: MessagesRequest, raw: Request) -> Any:
        try:
            return await _create(req, raw)
        except Exception as e:  # noqa: BLE001 - every failure in Anthropic's shape
            err = as_api_error(e)
            return JSONResponse(
                anthropic_error_body(err), status_code=err.status, headers=err.headers
            )

    async def _create(req: MessagesRequest, raw: Request) -> Any:
        model = check_model(engine, served, req.model)
        prompt_ids = render(req)
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            max_tokens=req.max_tokens,
            stop=list(req.stop_sequences or []),
        )
        message_id = f"msg_{uuid.uuid4().hex}"
        stream = engine.generate_tokens(None, prompt_ids, params, message_id)
        if req.stream:
            first = await anext(stream)
            return StreamingResponse(
                _events(message_id, model, len(prompt_ids), first, stream),
                media_type="text/event-stream",
            )
        text, num_out, finish, stop = await unless_disconnected(raw, _collect(stream))
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "stop_sequence"
            if isinstance(stop, str)
            else _STOP_REASONS.get(finish or "stop", "end_turn"),
            "stop_sequence": stop if isinstance(stop, str) else None,
            "usage": {"input_tokens": len(prompt_ids), "output_tokens": num_out},
        }

    return router


async def _collect(stream: AsyncIterator[RequestOutput]) -> tuple[str, int, str | None, Any]:
    text, num_out, finish, stop = "", 0, None, None
    async for out in stream:
        for o in out.outputs:
            text += o.text
            num_out += len(o.token_ids)
            finish, stop = o.finish_reason or finish, o.stop_reason
    return text, num_out, finish, stop


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(
    message_id: str,
    model: str,
    num_prompt: int,
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    yield _event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": num_prompt, "output_tokens": 0},
            },
        },
    )
    yield _event(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )
    yield _event("ping", {"type": "ping"})
    num_out, finish, stop = 0, None, None
    try:
        outputs = [first]
        while outputs:
            for out in outputs:
                for o in out.outputs:
                    num_out += len(o.token_ids)
                    finish, stop = o.finish_reason or finish, o.stop_reason
                    if o.text:
                        yield _event(
                            "content_block_delta",
                            {
                                "type": "content_block_delta",
                                "index": 0,
                                "delta": {"type": "text_delta", "text": o.text},
                            },
                        )
            nxt = await anext(rest, None)
            outputs = [nxt] if nxt is not None else []
    except Exception as e:  # noqa: BLE001 - reported in-band once the stream has started
        err = as_api_error(e)
        yield _event("error", anthropic_error_body(err))
        return
    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    reason = (
        "stop_sequence"
        if isinstance(stop, str)
        else _STOP_REASONS.get(finish or "stop", "end_turn")
    )
    yield _event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": reason,
                "stop_sequence": stop if isinstance(stop, str) else None,
            },
            "usage": {"output_tokens": num_out},
        },
    )
    yield _event("message_stop", {"type": "message_stop"})
