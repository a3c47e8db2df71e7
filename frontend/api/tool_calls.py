"""Tool calling: check tools and tool_choice, constrain or parse the reply.

- `none`: tools may be rendered into the prompt, the reply is plain content.
- `required` and a named function: the reply is forced by structured output
  (a JSON list of {name, parameters}, or the named function's arguments), so
  even a small model emits a valid call.
- `auto`: the model decides; a parser chosen by --tool-call-parser finds
  calls in its text (`hermes`: <tool_call>{json}</tool_call>; `llama3_json`:
  {"name", "parameters"} objects separated by ";").

Calls leave as OpenAI's tool_calls with `arguments` always a JSON string.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.tool_schema import required_calls_schema
from pagoda.protocol.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCall:
    """One parsed call."""

    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools, checked."""

    mode: str  # "none" | "auto" | "required" | "named"
    functions: dict[str, dict[str, Any]]  # name -> parameters schema
    named: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that forces a call, for required and named."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputsParams(json=_dumps(self.functions[self.named]))
        if self.mode == "required":
            schema = required_calls_schema(self.functions, self.parallel)
            return StructuredOutputsParams(json=_dumps(schema))
        return None


def check_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    parser: str | None,
) -> ToolRequest:
    """Validate tools / tool_choice (400 on any inconsistency)."""
    functions = _functions(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in functions:
            raise APIError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return ToolRequest("named", functions, name, parallel)
    if tool_choice not in ("none", "auto", "required"):
        raise APIError(
            400,
            f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}",
            "tool_choice",
        )
    if tool_choice != "none" and not functions:
        raise APIError(400, f"tool_choice {tool_choice!r} requires tools", "tool_choice")
    if tool_choice == "auto" and parser is None:
        raise APIError(
            400,
            '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
            "and --tool-call-parser",
            "tool_choice",
        )
    return ToolRequest(tool_choice, functions, None, parallel)


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools are allowed", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, 'a tool is {"type": "function", "function": {...}}', f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise APIError(
                400, "a function name is 1-64 letters, digits, _ . or -", f"tools.{i}.function.name"
            )
        if name in functions:
            raise APIError(400, f"duplicate function name {name!r}", f"tools.{i}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(
                400, "function parameters must be a JSON schema object", f"tools.{i}.function"
            )
        functions[name] = params
    return functions


def _dumps(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


# ----------------------------------------------------------------------------
# reading calls out of the reply
# ----------------------------------------------------------------------------


def calls_from_forced(request: ToolRequest, text: str) -> list[ToolCall] | None:
    """The calls in a reply forced by `constraint()`; None if it was cut short."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if request.mode == "named":
        assert request.named is not None
        return [ToolCall(request.named, _dumps_args(value))]
    if not isinstance(value, list):
        return None
    return [ToolCall(c["name"], _dumps_args(c.get("parameters", {}))) for c in value]


def _dumps_args(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the calls, calls) found by a named parser in a full reply."""
    if parser == "hermes":
        return _parse_hermes(text)
    if parser == "llama3_json":
        return _parse_llama3_json(text)
    raise ValueError(f"unknown tool call parser {parser!r}")


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        call = _call_from_json(body)
        if call is None:
            return text, []  # not a well-formed call: leave the text as content
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls = []
    pos = 0
    while pos < len(body):
        try:
            value, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = _call_from_value(value)
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def _call_from_json(body: str) -> ToolCall | None:
    try:
        return _call_from_value(json.loads(body))
    except json.JSONDecodeError:
        return None


def _call_from_value(value: object) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], _dumps_args(args))


def tool_call_start(parser: str) -> str:
    """The text that opens a call in a parser's format (for streaming)."""
    return "<tool_call>" if parser == "hermes" else "{"


# ----------------------------------------------------------------------------
# streaming
# ----------------------------------------------------------------------------


class ToolCallStream:
    """Turns one choice's streamed text into OpenAI chat deltas.

    Content streams as it comes until a call can start; from there the text is
    held and its calls are sent when the choice finishes (a named call's
    arguments, being the whole reply, stream as they come).
    """

    def __init__(self, request: ToolRequest, parser: str | None) -> None:
        self.request = request
        self.parser = parser
        self.text = ""
        self.num_sent = 0  # characters of text already sent as content
        self.in_calls = False
        self.made_calls = False
        self.named_call: ToolCall | None = None

    def delta(self, new_text: str, finished: bool) -> dict[str, Any]:
        """The delta for this piece of text; `finished` on the choice's last piece."""
        mode = self.request.mode
        if mode == "none":
            return {"content": new_text} if new_text else {}
        if mode == "named":
            return self._named(new_text)
        self.text += new_text
        if mode == "required":
            return self._flush_calls() if finished else {}
        content = self._auto_content() if not self.in_calls else ""
        delta: dict[str, Any] = {}
        if finished:
            delta = self._flush_calls()
            content += delta.pop("content", "")
        if content:
            delta["content"] = content
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.made_calls and reason == "stop" else reason

    def _named(self, new_text: str) -> dict[str, Any]:
        if not new_text:
            return {}
        self.made_calls = True
        if self.named_call is None:
            assert self.request.named is not None
            self.named_call = ToolCall(self.request.named, "")
            call = self.named_call.as_message()
            call["function"]["arguments"] = new_text
            return {"tool_calls": [{"index": 0, **call}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}

    def _auto_content(self) -> str:
        assert self.parser is not None
        text = self.text
        if self.parser == "llama3_json":
            head = text.lstrip()
            if not head or "<|python_tag|>".startswith(head):
                return ""  # undecided: hold it
            if head.startswith(("{", "<|python_tag|>")) and self.num_sent == 0:
                self.in_calls = True
                return ""
            safe = len(text)
        else:
            marker = tool_call_start(self.parser)
            at = text.find(marker, self.num_sent)
            if at >= 0:
                self.in_calls = True
                safe = at
            else:
                safe = len(text) - _partial_suffix(text, marker)
        out = text[self.num_sent : safe]
        self.num_sent = max(self.num_sent, safe)
        return out

    def _flush_calls(self) -> dict[str, Any]:
        rest = self.text[self.num_sent :]
        self.num_sent = len(self.text)
        if self.request.mode == "required":
            calls: list[ToolCall] | None = calls_from_forced(self.request, rest)
            content = None if calls else rest
        else:
            assert self.parser is not None
            content, calls = parse_tool_calls(self.parser, rest)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            self.made_calls = True
            delta["tool_calls"] = [{"index": i, **c.as_message()} for i, c in enumerate(calls)]
        return delta


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def reply_message(request: ToolRequest, parser: str | None, text: str) -> dict[str, Any]:
    """The assistant message of a whole (non-streamed) reply."""
    calls: list[ToolCall] | None = None
    content: str | None = text
    if request.mode in ("named", "required"):
        calls = calls_from_forced(request, text)
        if calls:
            content = None
    elif request.mode == "auto" and parser is not None:
        content, calls = parse_tool_calls(parser, text)
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [c.as_message() for c in calls or []],
    }
