"""POST /v1/responses: OpenAI's Responses API over the chat machinery.

A request is translated into a chat request (`responses_items.py`), so the
prompt, tools and structured output behave exactly as on chat. The reply's
text is turned into output items (an assistant message and function calls)
by one builder, used for both the streamed events and the final object, so
the two always agree.

Responses are kept in memory, per API server, bounded (oldest dropped
first): GET/DELETE /v1/responses/{id} and previous_response_id see only the
responses made through the same API server process.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from frontend.api.common import as_api_error, check_model, now, unless_disconnected
from frontend.api.errors import APIError
from frontend.api.responses_items import (
    ResponsesRequest,
    input_messages,
    output_messages,
    to_chat_request,
)
from frontend.api.serving_chat import ChatServer
from frontend.api.tool_calls import ToolCallStream, ToolRequest
from frontend.async_llm import AsyncLLM
from frontend.outputs import RequestOutput

MAX_STORED_RESPONSES = 1024


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Turns the reply's text, piece by piece, into output items and stream events.

    Text opens an assistant message item; each tool call opens a function
    call item (closing the message before it). Every item that is opened is
    closed with its `*.done` events, which agents depend on.
    """

    def __init__(self, tools: ToolRequest, parser: str | None) -> None:
        self.calls = ToolCallStream(tools, parser)
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []  # since the last take_events()
        self._message: dict[str, Any] | None = None
        self._call: dict[str, Any] | None = None

    def feed(self, text: str, finished: bool) -> None:
        delta = self.calls.delta(text, finished)
        if delta.get("content"):
            self._text(delta["content"])
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            if "id" in call:
                self._close()
                self._open_call(call["id"], fn["name"])
            self._arguments(fn.get("arguments", ""))
        if finished:
            self._close()

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def _emit(self, kind: str, **payload: Any) -> None:
        self.events.append({"type": kind, **payload})

    def _text(self, text: str) -> None:
        if self._call is not None:
            self._close()
        if self._message is None:
            self._message = {
                "type": "message",
                "id": _item_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.items.append(self._message)
            self._emit(
                "response.output_item.added", output_index=self._index, item=_copy(self._message)
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            self._emit(
                "response.content_part.added",
                item_id=self._message["id"],
                output_index=self._index,
                content_index=0,
                part=_copy(part),
            )
        self._message["content"][0]["text"] += text
        self._emit(
            "response.output_text.delta",
            item_id=self._message["id"],
            output_index=self._index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _open_call(self, call_id: str, name: str) -> None:
        self._call = {
            "type": "function_call",
            "id": _item_id("fc"),
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(self._call)
        self._emit("response.output_item.added", output_index=self._index, item=_copy(self._call))

    def _arguments(self, text: str) -> None:
        if not text or self._call is None:
            return
        self._call["arguments"] += text
        self._emit(
            "response.function_call_arguments.delta",
            item_id=self._call["id"],
            output_index=self._index,
            delta=text,
        )

    def _close(self) -> None:
        if self._message is not None:
            item, self._message = self._message, None
            part = item["content"][0]
            item["status"] = "completed"
            common = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
            self._emit("response.output_text.done", **common, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **common, part=_copy(part))
            self._emit("response.output_item.done", output_index=self._index, item=_copy(item))
        if self._call is not None:
            item, self._call = self._call, None
            item["status"] = "completed"
            self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=self._index,
                name=item["name"],
                arguments=item["arguments"],
            )
            self._emit("response.output_item.done", output_index=self._index, item=_copy(item))

    @property
    def _index(self) -> int:
        return len(self.items) - 1


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(value))
    return copied


@dataclass
class StoredResponse:
    """A finished response and the conversation that led to it."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]] = field(default_factory=list)


class ResponseStore:
    """Bounded in-memory store of this API server's responses (oldest dropped first)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response["id"]] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id {response_id!r} not found.", param)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


@dataclass
class _Turn:
    """One request's state while it is generated."""

    req: ResponsesRequest
    response_id: str
    created_at: int
    model: str
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
    num_prompt: int
    num_output: int = 0
    num_cached: int = 0
    finish_reason: str | None = None


class ResponsesServer:
    """Handles /v1/responses for one AsyncLLM."""

    def __init__(self, engine: AsyncLLM, served_names: list[str], chat: ChatServer) -> None:
        self.engine = engine
        self.served_names = served_names
        self.chat = chat
        self.store = ResponseStore()

    async def create(self, req: ResponsesRequest, raw: Request) -> Any:
        model = check_model(self.engine, self.served_names, req.model)
        extra = req.model_extra or {}
        if extra.get("background"):
            raise APIError(400, "background responses are not supported", "background")
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id, "previous_response_id").conversation
        new_messages = input_messages(req)
        chat_req = to_chat_request(req, history + new_messages)
        params, tools, prompt, prompt_ids = self.chat.prepare(chat_req)
        turn = _Turn(
            req,
            _item_id("resp"),
            now(),
            model,
            _input_items(req),
            history + new_messages,
            len(prompt_ids),
        )
        stream = self.engine.generate_tokens(
            prompt, prompt_ids, params, turn.response_id, priority=req.priority
        )
        builder = OutputBuilder(tools, self.chat.tool_parser)
        if req.stream:
            first = await anext(stream)  # a request the engine refuses is a 400, not an event
            return StreamingResponse(
                self._events(turn, builder, first, stream), media_type="text/event-stream"
            )
        async for out in _all(None, stream):
            self._feed(turn, builder, out)
        return JSONResponse(self._finish(turn, builder))

    def _feed(self, turn: _Turn, builder: OutputBuilder, out: RequestOutput) -> None:
        (o,) = out.outputs  # Responses always asks for one sample
        turn.num_output += len(o.token_ids)
        turn.num_cached = out.num_cached_tokens
        turn.finish_reason = o.finish_reason
        builder.feed(o.text, o.finish_reason is not None)

    async def _events(
        self,
        turn: _Turn,
        builder: OutputBuilder,
        first: RequestOutput,
        rest: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        seq = 0

        def event(payload: dict[str, Any]) -> str:
            nonlocal seq
            payload["sequence_number"] = seq
            seq += 1
            return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        started = self._object(turn, builder, "in_progress")
        yield event({"type": "response.created", "response": started})
        yield event({"type": "response.in_progress", "response": started})
        try:
            async for out in _all(first, rest):
                self._feed(turn, builder, out)
                for payload in builder.take_events():
                    yield event(payload)
        except Exception as e:  # noqa: BLE001 - reported in-band, as OpenAI does
            err = as_api_error(e)
            yield event(
                {"type": "error", "code": err.err_type, "message": err.message, "param": err.param}
            )
            return
        final = self._finish(turn, builder)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield event({"type": kind, "response": final})

    def _finish(self, turn: _Turn, builder: OutputBuilder) -> dict[str, Any]:
        status = "incomplete" if turn.finish_reason == "length" else "completed"
        response = self._object(turn, builder, status)
        if turn.req.store:
            conversation = turn.conversation + output_messages(builder.items)
            self.store.put(StoredResponse(response, turn.input_items, conversation))
        return response

    def _object(self, turn: _Turn, builder: OutputBuilder, status: str) -> dict[str, Any]:
        req = turn.req
        done = status != "in_progress"
        return {
            "id": turn.response_id,
            "object": "response",
            "created_at": turn.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "metadata": req.metadata or {},
            "model": turn.model,
            "output": _copy({"o": builder.items})["o"] if done else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": _usage(turn) if done else None,
            "user": req.user,
        }


def _usage(turn: _Turn) -> dict[str, Any]:
    return {
        "input_tokens": turn.num_prompt,
        "input_tokens_details": {"cached_tokens": turn.num_cached},
        "output_tokens": turn.num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": turn.num_prompt + turn.num_output,
    }


def _input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids, for GET .../input_items."""
    raw = req.input
    if isinstance(raw, str):
        raw = [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}
        ]
    items = []
    for item in raw:
        copied = _copy(item)
        copied.setdefault("type", "message")
        copied.setdefault("id", _item_id("msg" if copied["type"] == "message" else "item"))
        items.append(copied)
    return items


async def _all(
    first: RequestOutput | None, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
    async for out in rest:
        yield out


def build_router(
    engine: AsyncLLM,
    served_names: list[str],
    chat: ChatServer,
    counted: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]],
) -> APIRouter:
    """Routes of the Responses API; `counted` tracks in-flight generation requests."""
    router = APIRouter()
    server = ResponsesServer(engine, served_names, chat)

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        if body.stream:
            return await counted(lambda: server.create(body, request))
        return await counted(lambda: unless_disconnected(request, server.create(body, request)))

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return server.store.get(response_id).response

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        server.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str) -> dict[str, Any]:
        items = server.store.get(response_id).input_items
        return {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": False,
        }

    return router
