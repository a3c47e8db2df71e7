"""Anthropic Messages API with the official anthropic client against the real server."""

from __future__ import annotations

import time

import anthropic
import httpx
import jsonschema
import pytest

from tests.frontend.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def test_message_and_count_tokens(server: Server) -> None:
    c = client(server)
    msg = c.messages.create(
        model=MODEL_NAME, max_tokens=20, messages=QUESTION, extra_body={"temperature": 0}
    )  # type: ignore[arg-type]
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "text" and "Paris" in msg.content[0].text  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn"
    count = c.messages.count_tokens(model=MODEL_NAME, messages=QUESTION)  # type: ignore[arg-type]
    assert count.input_tokens == msg.usage.input_tokens > 0
    short = c.messages.create(
        model=MODEL_NAME, max_tokens=2, messages=QUESTION, extra_body={"temperature": 0}
    )  # type: ignore[arg-type]
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_system_and_stop_sequence(server: Server) -> None:
    c = client(server)
    base = c.messages.create(
        model=MODEL_NAME,
        max_tokens=20,
        messages=QUESTION,
        extra_body={"temperature": 0},
        system="Be brief.",  # type: ignore[arg-type]
    )
    text = base.content[0].text  # type: ignore[union-attr]
    stop = text.split()[2]
    cut = c.messages.create(
        model=MODEL_NAME,
        max_tokens=20,
        messages=QUESTION,
        extra_body={"temperature": 0},
        system="Be brief.",  # type: ignore[arg-type]
        stop_sequences=[stop],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_streaming_helpers(server: Server) -> None:
    c = client(server)
    full = c.messages.create(
        model=MODEL_NAME, max_tokens=20, messages=QUESTION, extra_body={"temperature": 0}
    )  # type: ignore[arg-type]
    with c.messages.stream(
        model=MODEL_NAME, max_tokens=20, messages=QUESTION, extra_body={"temperature": 0}
    ) as s:  # type: ignore[arg-type]
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == full.content[0].text  # type: ignore[union-attr]
    assert final.content[0].text == streamed  # type: ignore[union-attr]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens


def test_event_order(server: Server) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 5, "messages": QUESTION, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=60) as r:
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) <= {"content_block_delta"}


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": MODEL_NAME, "messages": QUESTION}, 400),  # max_tokens missing
        ({"model": MODEL_NAME, "max_tokens": 5, "messages": []}, 400),
        ({"model": "nope", "max_tokens": 5, "messages": QUESTION}, 404),
        (
            {
                "model": MODEL_NAME,
                "max_tokens": 5,
                "messages": [{"role": "system", "content": "x"}],
            },
            400,
        ),
        ({"model": MODEL_NAME, "max_tokens": 99999, "messages": QUESTION}, 400),
        ({"model": MODEL_NAME, "max_tokens": 5, "messages": QUESTION, "temperature": 3}, 400),
    ],
)
def test_errors_in_anthropic_shape(server: Server, body: dict, status: int) -> None:
    r = httpx.post(server.base_url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] and payload["error"]["message"]


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_tool_use_blocks(server: Server, choice: dict) -> None:
    c = client(server)
    kwargs: dict = dict(
        model=MODEL_NAME,
        max_tokens=80,
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice=choice,
        extra_body={"temperature": 0},
    )
    msg = c.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) >= 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_TOOL["input_schema"])
    with c.messages.stream(**kwargs) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [b.input for b in streamed] == [b.input for b in uses]
    assert "input_json" in events  # the SDK saw input_json_delta pieces


def test_tool_result_round_trip(server: Server) -> None:
    c = client(server)
    msg = c.messages.create(
        model=MODEL_NAME,
        max_tokens=20,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "none"},
        messages=[
            *ASK_WEATHER,
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C, sunny"}
                ],
            },
        ],
        extra_body={"temperature": 0},
    )  # type: ignore[arg-type]
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "sometimes"}},
        {"tools": [{"description": "no name"}]},
        {"tool_choice": {"type": "any"}},
    ],
)
def test_bad_tools_are_400(server: Server, extra: dict) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 5, "messages": ASK_WEATHER, **extra}
    r = httpx.post(server.base_url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"


def test_messages_count_in_server_load(server: Server) -> None:
    story = [{"role": "user", "content": "Write a very long story about a dragon."}]
    body = {"model": MODEL_NAME, "max_tokens": 400, "messages": story, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: a dropped iterator would close the stream
        next(lines)
        assert httpx.get(server.base_url + "/load", timeout=10).json()["server_load"] >= 1
    # The client went away mid-stream: the request counts itself out.
    deadline = time.monotonic() + 5
    while httpx.get(server.base_url + "/load", timeout=10).json()["server_load"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
