"""Output items of a response, built piece by piece, and the response store.

`OutputBuilder` turns the model's text into output items (an assistant
message, function calls, MCP calls and listings) and the typed stream events
that announce them. The same builder makes the final object and the stream,
so the two always agree. Every item that is opened is closed with its
`*.done` events, which agents depend on.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.tool_calls import ToolCallStream, ToolRequest

MAX_STORED_RESPONSES = 1024


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def copy_json(value: Any) -> Any:
    return json.loads(json.dumps(value))


class OutputBuilder:
    """Output items and stream events of one response, over one or more rounds.

    A round is one generation; between rounds the server runs the MCP calls
    the model made (`pending_mcp`) and reports them with `finish_mcp_call`.
    """

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []  # since the last take_events()
        self.pending_mcp: list[dict[str, Any]] = []
        self.round_items: list[dict[str, Any]] = []
        self._calls: ToolCallStream | None = None
        self._mcp_labels: dict[str, str] = {}
        self._message: dict[str, Any] | None = None
        self._call: dict[str, Any] | None = None

    def new_round(self, tools: ToolRequest, parser: str | None, mcp_labels: dict[str, str]) -> None:
        """Start a generation; `mcp_labels` maps MCP tool names to their server labels."""
        self._calls = ToolCallStream(tools, parser)
        self._mcp_labels = mcp_labels
        self.pending_mcp = []
        self.round_items = []

    def feed(self, text: str, finished: bool) -> None:
        assert self._calls is not None, "new_round() first"
        delta = self._calls.delta(text, finished)
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

    def list_tools(self, label: str, tools: list[dict[str, Any]]) -> None:
        """An mcp_list_tools item, complete at once."""
        item = {"type": "mcp_list_tools", "id": item_id("mcpl"), "server_label": label, "tools": []}
        index = self._add(item)
        self._emit("response.mcp_list_tools.in_progress", item_id=item["id"], output_index=index)
        item["tools"] = copy_json(tools)
        self._emit("response.mcp_list_tools.completed", item_id=item["id"], output_index=index)
        self._emit("response.output_item.done", output_index=index, item=copy_json(item))

    def finish_mcp_call(
        self, item: dict[str, Any], output: str | None, error: dict[str, Any] | None
    ) -> None:
        index = self.items.index(item)
        item["output"], item["error"] = output, error
        item["status"] = "failed" if error else "completed"
        kind = "response.mcp_call.failed" if error else "response.mcp_call.completed"
        self._emit(kind, item_id=item["id"], output_index=index)
        self._emit("response.output_item.done", output_index=index, item=copy_json(item))

    def _emit(self, kind: str, **payload: Any) -> None:
        self.events.append({"type": kind, **payload})

    def _add(self, item: dict[str, Any]) -> int:
        self.items.append(item)
        self.round_items.append(item)
        index = len(self.items) - 1
        self._emit("response.output_item.added", output_index=index, item=copy_json(item))
        return index

    def _text(self, text: str) -> None:
        if self._call is not None:
            self._close()
        if self._message is None:
            self._message = {
                "type": "message",
                "id": item_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            index = self._add(self._message)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            self._emit(
                "response.content_part.added",
                item_id=self._message["id"],
                output_index=index,
                content_index=0,
                part=copy_json(part),
            )
        self._message["content"][0]["text"] += text
        self._emit(
            "response.output_text.delta",
            item_id=self._message["id"],
            output_index=self.items.index(self._message),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _open_call(self, call_id: str, name: str) -> None:
        label = self._mcp_labels.get(name)
        if label is None:
            self._call = {
                "type": "function_call",
                "id": item_id("fc"),
                "call_id": call_id,
                "name": name,
                "arguments": "",
                "status": "in_progress",
            }
            self._add(self._call)
            return
        self._call = {
            "type": "mcp_call",
            "id": item_id("mcp"),
            "server_label": label,
            "name": name,
            "arguments": "",
            "output": None,
            "error": None,
            "status": "in_progress",
        }
        index = self._add(self._call)
        self._emit("response.mcp_call.in_progress", item_id=self._call["id"], output_index=index)

    def _arguments(self, text: str) -> None:
        if not text or self._call is None:
            return
        self._call["arguments"] += text
        kind = "mcp_call" if self._call["type"] == "mcp_call" else "function_call"
        self._emit(
            f"response.{kind}_arguments.delta",
            item_id=self._call["id"],
            output_index=self.items.index(self._call),
            delta=text,
        )

    def _close(self) -> None:
        if self._message is not None:
            item, self._message = self._message, None
            index = self.items.index(item)
            part = item["content"][0]
            item["status"] = "completed"
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            self._emit("response.output_text.done", **common, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **common, part=copy_json(part))
            self._emit("response.output_item.done", output_index=index, item=copy_json(item))
        if self._call is not None:
            item, self._call = self._call, None
            index = self.items.index(item)
            if item["type"] == "mcp_call":
                # Closed by finish_mcp_call() once the server has run it.
                self._emit(
                    "response.mcp_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
                self.pending_mcp.append(item)
                return
            item["status"] = "completed"
            self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            self._emit("response.output_item.done", output_index=index, item=copy_json(item))


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
