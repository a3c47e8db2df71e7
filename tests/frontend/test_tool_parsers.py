"""Tool-call parsing and streaming, on text (no model needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.tool_calls import (
    ToolCallStream,
    check_tools,
    parse_tool_calls,
    reply_message,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_hermes_calls_and_leading_content() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'
    )
    content, calls = parse_tool_calls("hermes", text)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert json.loads(calls[1].arguments) == {"tz": "CET"}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_llama3_json_calls() -> None:
    text = (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    content, calls = parse_tool_calls("llama3_json", text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", "No tools needed, the answer is 4."),
        ("hermes", "<tool_call>{not json}</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
        ("llama3_json", "Plain answer {with braces}"),
        ("llama3_json", '{"city": "Paris"}'),
    ],
)
def test_text_that_is_not_a_call_stays_content(parser: str, text: str) -> None:
    content, calls = parse_tool_calls(parser, text)
    assert calls == [] and content == text


def stream_pieces(parser: str, mode_tools: Any, text: str, size: int) -> list[dict[str, Any]]:
    request = check_tools(*mode_tools, parser)
    stream = ToolCallStream(request, parser)
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    return [stream.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_auto_deltas_add_up_to_the_whole_reply(size: int) -> None:
    text = (
        'Sure <tool<call> text\n<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Rome"}}</tool_call>'
    )
    deltas = stream_pieces("hermes", ([WEATHER], "auto", None), text, size)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    whole = reply_message(check_tools([WEATHER], "auto", None, "hermes"), "hermes", text)
    assert content.strip() == whole["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]
    # Nothing of the call leaks into content, even a partial "<tool_call>".
    assert "<tool_call" not in content


def test_streamed_named_call_streams_arguments() -> None:
    args = '{"city": "Lima"}'
    deltas = stream_pieces(
        "hermes",
        ([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None),
        args,
        4,
    )
    first = deltas[0]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("call_")
    joined = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(joined) == {"city": "Lima"}


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "needle"),
    [
        (None, "required", "hermes", "requires tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "hermes", "not in tools"),
        ([WEATHER], {"type": "function"}, "hermes", "named tool_choice"),
        ([WEATHER], "sometimes", "hermes", "tool_choice must be"),
        ([WEATHER], "auto", None, "--enable-auto-tool-choice"),
        ([WEATHER, WEATHER], "required", "hermes", "duplicate"),
        ([{"type": "function"}], "required", "hermes", "a tool is"),
        ([{"type": "function", "function": {"name": "a b"}}], "required", "hermes", "name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": 3}}],
            "required",
            None,
            "schema",
        ),
    ],
)
def test_inconsistent_tools_are_400(
    tools: Any, choice: Any, parser: str | None, needle: str
) -> None:
    with pytest.raises(APIError) as info:
        check_tools(tools, choice, None, parser)
    assert info.value.status == 400 and needle in str(info.value)
