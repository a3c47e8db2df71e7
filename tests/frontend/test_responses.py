"""The Responses API end to end with the official openai client, plus its translation rules."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.responses_items import ResponsesRequest, input_messages, to_chat_request
from pagoda.frontend.api.responses_output import OutputBuilder
from pagoda.frontend.api.tool_calls import check_tools
from tests.frontend.conftest import MODEL_NAME, Server
from tests.frontend.test_openai_e2e import client
from tests.frontend.test_tool_calling import TOOL_TEMPLATE, TOOLS, check_call

FLAT_TOOLS: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
ASK = "What is the weather in Paris?"
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


# ----------------------------------------------------------------------------
# translation (no server)
# ----------------------------------------------------------------------------


def test_input_items_become_chat_messages() -> None:
    req = ResponsesRequest(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "summary": []},
        ],
        tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        text={"format": {"type": "json_schema", "name": "x", "schema": CITY_SCHEMA}},
        max_output_tokens=7,
    )
    chat = to_chat_request(req, input_messages(req))
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in chat.messages[2].tool_calls or []] == ["c1", "c2"]
    assert chat.messages[3].tool_call_id == "c1" and chat.messages[3].content == "sunny"
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_time"}}
    assert chat.tools and chat.tools[0]["function"]["name"] == "get_weather"
    assert chat.max_completion_tokens == 7
    assert chat.response_format is not None and chat.response_format.type == "json_schema"


@pytest.mark.parametrize(
    "body",
    [
        {"input": [{"type": "image_generation_call"}]},
        {"input": [{"role": "robot", "content": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"input": [{"type": "function_call", "name": "f"}]},
        {"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
        {"input": ""},
        {"input": []},
    ],
)
def test_bad_input_items_are_400(body: dict[str, Any]) -> None:
    with pytest.raises(APIError) as e:
        input_messages(ResponsesRequest.model_validate(body))
    assert e.value.status == 400 and e.value.param is not None


def test_output_builder_event_order() -> None:
    builder = OutputBuilder()
    builder.new_round(check_tools(None, None, None, None), None, {})
    for piece, last in (("Hel", False), ("lo", False), ("", True)):
        builder.feed(piece, last)
    kinds = [e["type"] for e in builder.take_events()]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    (item,) = builder.items
    assert item["content"][0]["text"] == "Hello" and item["status"] == "completed"


def test_output_builder_text_then_calls() -> None:
    tools = check_tools(TOOLS, "auto", None, "hermes")
    builder = OutputBuilder()
    builder.new_round(tools, "hermes", {})
    text = 'Let me check. <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    for i in range(0, len(text), 5):
        builder.feed(text[i : i + 5], False)
    builder.feed("", True)
    kinds = [item["type"] for item in builder.items]
    assert kinds == ["message", "function_call"]
    assert builder.items[0]["content"][0]["text"].strip() == "Let me check."
    assert json.loads(builder.items[1]["arguments"]) == {"tz": "UTC"}
    events = builder.take_events()
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]


# ----------------------------------------------------------------------------
# end to end
# ----------------------------------------------------------------------------

slow = pytest.mark.slow


@slow
def test_create_matches_chat(server: Server) -> None:
    c = client(server)
    r = c.responses.create(
        model=MODEL_NAME,
        instructions="You are terse.",
        input="Name a color.",
        temperature=0,
        max_output_tokens=12,
    )
    chat = c.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."},
        ],
        temperature=0,
        max_tokens=12,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete"
        assert r.incomplete_details and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"


@slow
def test_incomplete_and_stream_events(server: Server) -> None:
    c = client(server)
    events = list(
        c.responses.create(
            model=MODEL_NAME,
            input="Write a long story about a dragon.",
            max_output_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "incomplete" and final.output_text == deltas
    assert final.incomplete_details and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage is not None and final.usage.output_tokens == 6
    plain = c.responses.create(
        model=MODEL_NAME,
        input="Write a long story about a dragon.",
        max_output_tokens=6,
        temperature=0,
    )
    assert plain.output_text == deltas


@slow
def test_stream_helper_and_raw_sse(server: Server) -> None:
    c = client(server)
    with c.responses.stream(
        model=MODEL_NAME, input="Say hi.", max_output_tokens=64, temperature=0
    ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text and final.id.startswith("resp_")
    body = {"model": MODEL_NAME, "input": "Say hi.", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", server.v1 + "/responses", json=body, timeout=60) as r:
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    for block in blocks:  # `event: TYPE` matches the payload's type; no [DONE]
        head, data = block.split("\n", 1)
        assert head == f"event: {json.loads(data.removeprefix('data: '))['type']}"
    assert "[DONE]" not in raw


@slow
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(server: Server, stream: bool) -> None:
    c = client(server)
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME,
        input="Give a city and its population as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}},
        max_output_tokens=60,
        temperature=0,
    )
    if stream:
        with c.responses.stream(**kwargs) as s:
            final = s.get_final_response()
    else:
        final = c.responses.create(**kwargs)
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), CITY_SCHEMA)


@slow
@pytest.mark.parametrize("stream", [False, True])
def test_named_function_call_and_its_output(server: Server, stream: bool) -> None:
    c = client(server)
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME,
        input=ASK,
        tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
        temperature=0,
    )
    if stream:
        events = list(c.responses.create(stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and kinds[-1] == "response.completed"
        r = events[-1].response  # type: ignore[union-attr]
        assert done[0].arguments == r.output[0].arguments  # type: ignore[union-attr]
    else:
        r = c.responses.create(**kwargs)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    check_call("get_weather", call.arguments)
    assert call.call_id.startswith("call_")

    # Feed the result back; the model answers in text, rendered through a tool template.
    follow = c.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"},
        ],
        tools=FLAT_TOOLS,
        tool_choice="none",
        max_output_tokens=20,
        temperature=0,
        extra_body={"chat_template": TOOL_TEMPLATE},
    )
    assert follow.output[0].type == "message" and follow.output_text


@slow
def test_store_retrieve_chain_and_delete(server: Server) -> None:
    c = client(server)
    first = c.responses.create(
        model=MODEL_NAME, input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    got = c.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    items = httpx.get(f"{server.v1}/responses/{first.id}/input_items", timeout=10).json()
    assert items["data"][0]["content"][0]["text"] == "My name is Ada."
    second = c.responses.create(
        model=MODEL_NAME,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert first.usage and second.usage
    # The first turn (question and answer) is part of the second prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODEL_NAME, input="x", previous_response_id=first.id)
    unstored = c.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


@slow
@pytest.mark.parametrize(
    "body",
    [
        {"input": [{"type": "computer_call"}]},
        {"input": "x", "tools": [{"type": "web_search"}]},
        {"input": "x", "tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
        {"input": "x", "text": {"format": {"type": "yaml"}}},
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": 5}}},
        {"input": "x", "max_output_tokens": 0},
        {"input": 42},
        {"input": "x", "background": True},
        {"input": "x", "model": "other-model"},
    ],
)
def test_bad_requests_are_4xx(server: Server, body: dict[str, Any]) -> None:
    r = httpx.post(server.v1 + "/responses", json={"model": MODEL_NAME, **body}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
