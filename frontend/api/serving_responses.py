"""POST /v1/responses: OpenAI's Responses API over the chat machinery.

A request is translated into a chat request (`responses_items.py`), so the
prompt, tools and structured output behave exactly as on chat. One builder
(`responses_output.py`) turns the reply into output items and stream events.

With `{"type": "mcp"}` tools the server runs the model's calls on the
configured MCP servers (`mcp_tools.py`) and generates again with their
results, until the model answers without calling one, up to
`max_tool_calls` (default MAX_MCP_CALLS) calls.

The generation runs in its own task (`_produce`), which owns the request's
MCP sessions, so they are opened and closed in one task, whether the
request succeeds, fails or its client goes away.

Responses are kept in memory, per API server, bounded (oldest dropped
first): GET/DELETE /v1/responses/{id} and previous_response_id see only the
responses made through the same API server process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.frontend.api.common import (
    as_api_error,
    check_model,
    event_json,
    lora_for,
    now,
    unless_disconnected,
)
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.mcp_tools import McpRequest, McpSession, ToolServer, mcp_requests
from pagoda.frontend.api.responses_items import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    input_messages,
    output_messages,
    to_chat_request,
)
from pagoda.frontend.api.responses_output import (
    OutputBuilder,
    ResponseStore,
    StoredResponse,
    copy_json,
    item_id,
)
from pagoda.frontend.api.serving_chat import ChatServer
from pagoda.frontend.async_llm import AsyncLLM

MAX_MCP_CALLS = 8
_STARTED = {"type": "_started"}  # internal: the engine accepted the first round


@dataclass
class _Turn:
    """One request's state while it is generated."""

    req: ResponsesRequest
    response_id: str
    created_at: int
    model: str
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
    builder: OutputBuilder
    num_prompt: int = 0
    num_output: int = 0
    num_cached: int = 0
    finish_reason: str | None = None


class ResponsesServer:
    """Handles /v1/responses for one AsyncLLM."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_names: list[str],
        chat: ChatServer,
        tool_servers: dict[str, ToolServer] | None = None,
    ) -> None:
        self.engine = engine
        self.served_names = served_names
        self.chat = chat
        self.tool_servers = tool_servers or {}
        self.store = ResponseStore()

    async def create(self, req: ResponsesRequest, raw: Request) -> Any:
        model = check_model(self.engine, self.served_names, req.model)
        if (req.model_extra or {}).get("background"):
            raise APIError(400, "background responses are not supported", "background")
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id, "previous_response_id").conversation
        functions, wanted = mcp_requests(req.tools, self.tool_servers)
        turn = _Turn(
            req,
            item_id("resp"),
            now(),
            model,
            _input_items(req),
            history + input_messages(req),
            OutputBuilder(),
        )
        queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()
        producer = asyncio.create_task(self._produce(turn, chat_tools(functions), wanted, queue))
        try:
            # Anything refused before the engine starts (bad tools, a prompt
            # too long, an unreachable MCP server) is an HTTP error, not an event.
            first = await queue.get()
            if isinstance(first, BaseException):
                raise first
            if first is None:
                queue.put_nowait(None)  # finished without output: let the reader see the end
        except BaseException:
            producer.cancel()
            raise
        if req.stream:
            return StreamingResponse(
                self._sse(turn, producer, queue), media_type="text/event-stream"
            )
        try:
            await unless_disconnected(raw, _drain(queue))
        finally:
            producer.cancel()
        return JSONResponse(self._finish(turn))

    async def _produce(
        self,
        turn: _Turn,
        functions: list[dict[str, Any]] | None,
        wanted: list[McpRequest],
        queue: asyncio.Queue[dict[str, Any] | BaseException | None],
    ) -> None:
        """Generate (and run MCP calls) in this task; events go to `queue`, then None."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                session = None
                if wanted:
                    session = await stack.enter_async_context(McpSession(wanted))
                await self._rounds(turn, functions, session, queue)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer to report
            await queue.put(e)

    async def _rounds(
        self,
        turn: _Turn,
        functions: list[dict[str, Any]] | None,
        session: McpSession | None,
        queue: asyncio.Queue[dict[str, Any] | BaseException | None],
    ) -> None:
        req, builder = turn.req, turn.builder
        tools = list(functions or [])
        labels: dict[str, str] = {}
        if session is not None:
            tools += session.functions
            labels = {name: owner[0] for name, owner in session.owner.items()}
            for label, listed in session.listings:
                builder.list_tools(label, listed)
        tool_choice = chat_tool_choice(req.tool_choice)
        budget = req.max_tool_calls or MAX_MCP_CALLS
        started = False
        while True:
            chat_req = to_chat_request(req, turn.conversation, tools or None, tool_choice)
            params, tool_req, prompt, prompt_ids = self.chat.prepare(chat_req)
            builder.new_round(tool_req, self.chat.tool_parser, labels)
            turn.num_prompt += len(prompt_ids)
            stream = self.engine.generate_tokens(
                prompt,
                prompt_ids,
                params,
                item_id("resp"),
                priority=req.priority,
                lora_request=lora_for(self.engine, req.model or ""),
            )
            async for out in stream:
                if not started:
                    started = True
                    await queue.put(_STARTED)
                (o,) = out.outputs  # Responses always asks for one sample
                turn.num_output += len(o.token_ids)
                turn.num_cached += out.num_cached_tokens if o.finish_reason else 0
                turn.finish_reason = o.finish_reason
                builder.feed(o.text, o.finish_reason is not None)
                for event in builder.take_events():
                    await queue.put(event)
            pending = builder.pending_mcp
            if not pending:
                break
            assert session is not None
            for item in pending:
                if budget <= 0:
                    builder.finish_mcp_call(
                        item,
                        None,
                        {"type": "mcp_protocol_error", "code": -32000, "message": "max_tool_calls"},
                    )
                    continue
                budget -= 1
                output, error = await session.call(item["name"], item["arguments"])
                builder.finish_mcp_call(item, output, error)
            for event in builder.take_events():
                await queue.put(event)
            turn.conversation += output_messages(builder.round_items)
            only_mcp = all(i["type"] != "function_call" for i in builder.round_items)
            if budget <= 0 or turn.finish_reason == "length" or not only_mcp:
                break
            tool_choice = "auto" if self.chat.tool_parser else "none"

    async def _sse(
        self,
        turn: _Turn,
        producer: asyncio.Task[None],
        queue: asyncio.Queue[dict[str, Any] | BaseException | None],
    ) -> AsyncIterator[str]:
        seq = 0

        def event(payload: dict[str, Any]) -> str:
            nonlocal seq
            payload["sequence_number"] = seq
            seq += 1
            return f"event: {payload['type']}\ndata: {event_json(payload)}\n\n"

        try:
            started = self._object(turn, "in_progress")
            yield event({"type": "response.created", "response": started})
            yield event({"type": "response.in_progress", "response": copy_json(started)})
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    err = as_api_error(item)
                    yield event(
                        {
                            "type": "error",
                            "code": err.err_type,
                            "message": err.message,
                            "param": err.param,
                        }
                    )
                    return
                yield event(item)
            final = self._finish(turn)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield event({"type": kind, "response": final})
        finally:
            producer.cancel()  # a client that went away stops generation and closes MCP sessions

    def _finish(self, turn: _Turn) -> dict[str, Any]:
        status = "incomplete" if turn.finish_reason == "length" else "completed"
        response = self._object(turn, status)
        if turn.req.store:
            self.store.put(StoredResponse(response, turn.input_items, turn.conversation))
        return response

    def _object(self, turn: _Turn, status: str) -> dict[str, Any]:
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
            "output": copy_json(turn.builder.items) if done else [],
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


async def _drain(queue: asyncio.Queue[dict[str, Any] | BaseException | None]) -> None:
    while (item := await queue.get()) is not None:
        if isinstance(item, BaseException):
            raise item


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
        copied = copy_json(item)
        copied.setdefault("type", "message")
        copied.setdefault("id", item_id("msg" if copied["type"] == "message" else "item"))
        items.append(copied)
    return items


def build_router(
    engine: AsyncLLM,
    served_names: list[str],
    chat: ChatServer,
    counted: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]],
    tool_servers: dict[str, ToolServer] | None = None,
) -> APIRouter:
    """Routes of the Responses API; `counted` tracks in-flight generation requests."""
    router = APIRouter()
    server = ResponsesServer(engine, served_names, chat, tool_servers)

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        return await counted(lambda: server.create(body, request))

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
