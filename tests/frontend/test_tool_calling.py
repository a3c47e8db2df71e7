"""Tool calling end to end with the official openai client (server: --tool-call-parser hermes)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.frontend.conftest import MODEL_NAME, Server
from tests.frontend.test_openai_e2e import client

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "maxLength": 20}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}

# Renders tools, assistant tool calls and tool results (ChatML shaped).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:"
    "{% for t in tools %} {{ t.function.name }}{{ t.function.parameters | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}"
    "{%- elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{%- else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def check_call(name: str, arguments: str) -> None:
    assert isinstance(arguments, str)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_choice(server: Server) -> None:
    c = client(server)
    reply = c.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=80
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"
    check_call("get_weather", calls[0].function.arguments)

    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            tools=TOOLS,
            tool_choice=NAMED,
            temperature=0,
            max_tokens=80,
            stream=True,
        )
    )
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].id == calls[0].id or deltas[0].id  # an id on the first delta
    assert deltas[0].function and deltas[0].function.name == "get_weather"
    arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert arguments == calls[0].function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice(server: Server, stream: bool) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0.8,
        seed=11,
        max_tokens=150,
    )
    c = client(server)
    if not stream:
        reply = c.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "tool_calls"
        assert reply.choices[0].message.content is None
        calls = [
            (t.function.name, t.function.arguments)
            for t in reply.choices[0].message.tool_calls or []
        ]
    else:
        chunks = list(c.chat.completions.create(stream=True, **kwargs))
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert all(d.id and d.type == "function" for d in deltas)
        calls = [(d.function.name, d.function.arguments) for d in deltas if d.function]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls
    for name, arguments in calls:
        check_call(name, arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_calls(server: Server, stream: bool) -> None:
    # The regex makes the model write a hermes-format call, so the parser's path runs.
    args = '{"city": "Paris", "unit": "celsius"}'
    call = f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>'
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        extra_body={
            "structured_outputs": {
                "regex": "Checking\\. " + call.replace("{", "\\{").replace("}", "\\}")
            }
        },
    )
    c = client(server)
    if stream:
        chunks = list(c.chat.completions.create(stream=True, **kwargs))
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        names = [(d.function.name, d.function.arguments) for d in deltas if d.function]
    else:
        reply = c.chat.completions.create(**kwargs)
        content = reply.choices[0].message.content or ""
        finish = reply.choices[0].finish_reason
        names = [
            (t.function.name, t.function.arguments)
            for t in reply.choices[0].message.tool_calls or []
        ]
    assert content.strip() == "Checking."
    assert finish == "tool_calls"
    assert [(n, json.loads(a or "")) for n, a in names] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]


def test_auto_without_a_call_is_plain_content(server: Server) -> None:
    reply = client(server).chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=20
    )
    assert reply.choices[0].message.content
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_tool_history_renders_through_the_template(server: Server) -> None:
    first = client(server).chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=80
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    body = {
        "model": MODEL_NAME,
        "messages": history,
        "tools": TOOLS,
        "chat_template": TOOL_TEMPLATE,
    }
    rendered = httpx.post(server.v1 + "/chat/completions/render", json=body, timeout=30).json()
    prompt = rendered["prompt"]
    assert "Tools: get_weather" in prompt and "get_time" in prompt
    args = json.loads(call.function.arguments)
    # arguments arrive as a JSON string and reach the template as an object
    assert f'"arguments": {json.dumps(args)}' in prompt.replace(', "', ', "')
    assert "<tool_response>18 degrees, sunny</tool_response>" in prompt
    answer = client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=20,
        extra_body={"chat_template": TOOL_TEMPLATE},
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"tool_choice": "required"}, "requires tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "not in tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "duplicate"),
        ({"tools": "get_weather"}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
    ],
)
def test_inconsistent_tool_requests_are_400(server: Server, extra: dict, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(
            model=MODEL_NAME, messages=ASK, max_tokens=5, extra_body=extra
        )
    assert needle in str(info.value)
