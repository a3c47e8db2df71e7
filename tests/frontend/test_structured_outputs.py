"""Structured output end to end: constrained text always parses and validates."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.frontend.conftest import MODEL_NAME, Server
from tests.frontend.test_openai_e2e import aclient, client, engine_stats

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person called Anna as JSON."}]


def test_json_schema_chat_stream_and_not(server: Server) -> None:
    c = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for temperature in (0.0, 1.0):
        reply = c.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            response_format=fmt,  # type: ignore[arg-type]
            temperature=temperature,
            seed=3,
            max_tokens=200,
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)
    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            response_format=fmt,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=200,
            stream=True,
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(streamed), PERSON)


def test_json_object(server: Server) -> None:
    c = client(server)
    reply = c.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Return a JSON object with the capital of France."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


async def test_mixed_batch_constrained_and_free(server: Server) -> None:
    """Constrained and unconstrained requests share steps; each keeps its own rules."""
    c = aclient(server)

    free = c.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0, max_tokens=30)
    choice = c.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        temperature=1.0,
        max_tokens=10,
    )
    regex = c.completions.create(
        model=MODEL_NAME,
        prompt="My phone number is",
        extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}},
        temperature=0.7,
        seed=5,
        max_tokens=20,
    )
    grammar = c.completions.create(
        model=MODEL_NAME,
        prompt="Count:",
        extra_body={"structured_outputs": {"grammar": 'root ::= " " [1-9] (", " [1-9])*'}},
        temperature=0,
        max_tokens=12,
    )
    r_free, r_choice, r_regex, r_grammar = await asyncio.gather(free, choice, regex, grammar)
    assert r_free.choices[0].message.content
    assert r_choice.choices[0].message.content in ("yes", "no", "maybe")
    assert r_choice.choices[0].finish_reason == "stop"
    assert re.fullmatch(r" \d{3}-\d{4}", r_regex.choices[0].text)
    assert re.fullmatch(r" [1-9](, [1-9])*(, ?)?", r_grammar.choices[0].text)


def test_guided_json_alias_and_completions_stream(server: Server) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    stream = client(server).completions.create(
        model=MODEL_NAME,
        prompt="A JSON object:",
        extra_body={"guided_json": schema},
        temperature=0,
        max_tokens=40,
        stream=True,
    )
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"response_format": {"type": "yaml"}}, "yaml"),
        ({"response_format": "json"}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "invalid regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "invalid grammar"),
        ({"structured_outputs": {"json": {"type": 5}}}, "invalid JSON schema"),
        ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {}}, "exactly one"),
        (
            {
                "response_format": {"type": "json_object"},
                "structured_outputs": {"regex": "a"},
            },
            "only one",
        ),
        ({"guided_choice": "yes"}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400(server: Server, body: dict, needle: str) -> None:
    for stream in (False, True):
        r = httpx.post(
            server.v1 + "/chat/completions",
            json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 5, "stream": stream, **body},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
    stats = engine_stats(server)
    assert stats["num_waiting"] == 0


def test_bad_schema_with_openai_client(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        client(server).completions.create(
            model=MODEL_NAME,
            prompt="x",
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": "(unclosed"}},
        )
