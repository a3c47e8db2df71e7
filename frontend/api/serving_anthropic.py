"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A Messages request is translated into a chat request (text, tool_use and
tool_result blocks onto the chat template's roles; tools and tool_choice
onto chat's), so prompts, tool parsing and forced tool choices behave as on
/v1/chat/completions. The reply comes back as text and tool_use blocks,
streamed with the full event sequence (message_start, content_block_start,
ping, content_block_delta..., content_block_stop, message_delta,
message_stop). Errors use Anthropic's shape.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pagoda.frontend.api.common import (
    as_api_error,
    check_model,
    event_json,
    lora_for,
    unless_disconnected,
)
from pagoda.frontend.api.errors import APIError, anthropic_error_body
from pagoda.frontend.api.openai_models import ChatCompletionRequest
from pagoda.frontend.api.serving_chat import ChatServer
from pagoda.frontend.api.tool_calls import ToolCallStream, ToolRequest
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.outputs import RequestOutput

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
    tool_choice: dict[str, Any] | None = None


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


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool.get("name"), str):
            raise APIError(400, "every tool needs a string name", f"tools.{i}.name")
        fn = {
            "name": tool["name"],
            "description": tool.get("description", ""),
            "parameters": tool.get("input_schema", {"type": "object"}),
        }
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(
    choice: dict[str, Any] | None, has_tools: bool
) -> tuple[str | dict[str, Any] | None, bool | None]:
    """Anthropic tool_choice → chat's (tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return ("auto" if has_tools else None), parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(
        400, 'tool_choice.type must be auto, any, none or tool (with a "name")', "tool_choice"
    )


def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request an Anthropic request means."""
    tools = _chat_tools(req.tools)
    choice, parallel = _chat_tool_choice(req.tool_choice, bool(tools))
    body: dict[str, Any] = {"messages": to_chat_messages(req), "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    if isinstance(req, MessagesRequest):
        body |= {
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
        }
    return ChatCompletionRequest.model_validate(body)


def _stop_reason(finish: str | None, stop: object, made_calls: bool) -> str:
    if isinstance(stop, str):
        return "stop_sequence"
    if made_calls and finish == "stop":
        return "tool_use"
    return _STOP_REASONS.get(finish or "stop", "end_turn")


class BlockBuilder:
    """Turns the reply's text, piece by piece, into content blocks and stream events."""

    def __init__(self, tools: ToolRequest, parser: str | None) -> None:
        self.calls = ToolCallStream(tools, parser)
        self.blocks: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []  # since the last take_events()
        self._open: dict[str, Any] | None = None
        self._arguments = ""

    def feed(self, text: str, finished: bool) -> None:
        delta = self.calls.delta(text, finished)
        if delta.get("content"):
            if self._open is None or self._open["type"] != "text":
                self._start({"type": "text", "text": ""})
            self._open_block()["text"] += delta["content"]
            self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            if "id" in call:
                tool_id = "toolu_" + call["id"].removeprefix("call_")
                self._start({"type": "tool_use", "id": tool_id, "name": fn["name"], "input": {}})
            arguments = fn.get("arguments", "")
            if arguments and self._open is not None and self._open["type"] == "tool_use":
                self._arguments += arguments
                self._delta({"type": "input_json_delta", "partial_json": arguments})
        if finished:
            self._stop()

    def take_events(self) -> list[tuple[str, dict[str, Any]]]:
        events, self.events = self.events, []
        return events

    @property
    def made_calls(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _open_block(self) -> dict[str, Any]:
        assert self._open is not None
        return self._open

    def _start(self, block: dict[str, Any]) -> None:
        self._stop()
        self._open = block
        self.blocks.append(block)
        start = {"type": "content_block_start", "index": len(self.blocks) - 1}
        self.events.append(("content_block_start", start | {"content_block": dict(block)}))

    def _delta(self, delta: dict[str, Any]) -> None:
        index = len(self.blocks) - 1
        self.events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        )

    def _stop(self) -> None:
        if self._open is None:
            return
        if self._open["type"] == "tool_use":
            try:
                value = json.loads(self._arguments or "{}")
            except ValueError:
                value = {}  # cut off by max_tokens: no usable input
            self._open["input"] = value if isinstance(value, dict) else {"value": value}
            self._arguments = ""
        self._open = None
        index = len(self.blocks) - 1
        self.events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))


def build_router(
    engine: AsyncLLM,
    served: list[str],
    chat: ChatServer,
    counted: Callable[..., Awaitable[Any]],
) -> APIRouter:
    """Anthropic's routes; `counted` tracks in-flight generation requests (GET /load)."""
    router = APIRouter()

    def anthropic_response(err: APIError) -> JSONResponse:
        return JSONResponse(anthropic_error_body(err), status_code=err.status, headers=err.headers)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest) -> Any:
        try:
            check_model(engine, served, req.model)
            _params, _tools, _prompt, prompt_ids = chat.prepare(to_chat_request(req))
        except Exception as e:  # noqa: BLE001 - every failure in Anthropic's shape
            err = as_api_error(e)
            return JSONResponse(anthropic_error_body(err), status_code=err.status)
        return {"input_tokens": len(prompt_ids)}

    @router.post("/v1/messages")
    async def messages(req: MessagesRequest, raw: Request) -> Any:
        async def create() -> Any:
            try:
                return await _create(req, raw)
            except Exception as e:  # noqa: BLE001 - every failure in Anthropic's shape
                return anthropic_response(as_api_error(e))

        return await counted(create, anthropic_response)

    async def _create(req: MessagesRequest, raw: Request) -> Any:
        model = check_model(engine, served, req.model)
        params, tools, prompt, prompt_ids = chat.prepare(to_chat_request(req))
        message_id = f"msg_{uuid.uuid4().hex}"
        stream = engine.generate_tokens(
            prompt, prompt_ids, params, message_id, lora_request=lora_for(engine, model)
        )
        builder = BlockBuilder(tools, chat.tool_parser)
        if req.stream:
            first = await anext(stream)
            return StreamingResponse(
                _events(message_id, model, len(prompt_ids), builder, first, stream),
                media_type="text/event-stream",
            )
        num_out, finish, stop = await unless_disconnected(raw, _collect(stream, builder))
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": builder.blocks,
            "stop_reason": _stop_reason(finish, stop, builder.made_calls),
            "stop_sequence": stop if isinstance(stop, str) else None,
            "usage": {"input_tokens": len(prompt_ids), "output_tokens": num_out},
        }

    return router


async def _collect(
    stream: AsyncIterator[RequestOutput], builder: BlockBuilder
) -> tuple[int, str | None, Any]:
    num_out, finish, stop = 0, None, None
    async for out in stream:
        for o in out.outputs:
            num_out += len(o.token_ids)
            finish, stop = o.finish_reason or finish, o.stop_reason
            builder.feed(o.text, o.finish_reason is not None)
    return num_out, finish, stop


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {event_json(data)}\n\n"


async def _events(
    message_id: str,
    model: str,
    num_prompt: int,
    builder: BlockBuilder,
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
    pinged = False
    num_out, finish, stop = 0, None, None
    try:
        outputs = [first]
        while outputs:
            for out in outputs:
                for o in out.outputs:
                    num_out += len(o.token_ids)
                    finish, stop = o.finish_reason or finish, o.stop_reason
                    builder.feed(o.text, o.finish_reason is not None)
            for name, data in builder.take_events():
                yield _event(name, data)
                if not pinged:  # Anthropic pings right after the first block starts
                    pinged = True
                    yield _event("ping", {"type": "ping"})
            nxt = await anext(rest, None)
            outputs = [nxt] if nxt is not None else []
    except Exception as e:  # noqa: BLE001 - reported in-band once the stream has started
        err = as_api_error(e)
        yield _event("error", anthropic_error_body(err))
        return
    if not pinged:
        yield _event("ping", {"type": "ping"})
    yield _event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": _stop_reason(finish, stop, builder.made_calls),
                "stop_sequence": stop if isinstance(stop, str) else None,
            },
            "usage": {"output_tokens": num_out},
        },
    )
    yield _event("message_stop", {"type": "message_stop"})
