"""Recursive tool schemas with a forced call ("required" / Anthropic "any"), end to end.

Three tools at once, each with its own local definitions: two both name theirs
"$defs/node" (one a tree, one a list), one recurses through `$ref: "#"`. The reply
must be a call whose arguments validate against that tool's *original* schema.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.frontend.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow

TREE = {
    "type": "object",
    "properties": {
        "root": {"$ref": "#/$defs/node"},
        # Forces the generation down the reference twice.
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "minItems": 2, "maxItems": 2},
    },
    "required": ["root", "kids"],
    "additionalProperties": False,
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "label": {"type": "string", "maxLength": 12},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["label"],
            "additionalProperties": False,
        }
    },
}
LINKED = {
    "type": "object",
    "properties": {"head": {"$ref": "#/$defs/node"}},
    "required": ["head"],
    "additionalProperties": False,
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"value": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
            "required": ["value"],
            "additionalProperties": False,
        }
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "manager": {"$ref": "#"},
        "team": {"$ref": "#/definitions/team"},
    },
    "required": ["name"],
    "additionalProperties": False,
    "definitions": {"team": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
}
SCHEMAS = {"tree": TREE, "linked": LINKED, "person": PERSON}
ASK = "Make a family tree for Ann with two children, Bob and Cy."
# Long enough for one call; a call cut short would not parse.
MAX_TOKENS = 80


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}, timeout=180)
    assert r.status_code == 200, r.text[:500]
    return dict(r.json())


def check_call(name: str, arguments: Any) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(arguments, SCHEMAS[name])


def test_chat_required(server: Server) -> None:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()
    ]
    body = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": ASK}],
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        },
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1
    check_call(calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"]))


def test_messages_any(server: Server) -> None:
    # Greedy, this model picks "tree" here (and "linked" from all three).
    tools = [{"name": n, "input_schema": SCHEMAS[n]} for n in ("tree", "person")]
    body = post(
        server,
        "/v1/messages",
        {
            "messages": [{"role": "user", "content": ASK}],
            "tools": tools,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        },
    )
    assert body["stop_reason"] == "tool_use", body
    uses = [b for b in body["content"] if b["type"] == "tool_use"]
    assert len(uses) == 1
    check_call(uses[0]["name"], uses[0]["input"])


def test_responses_required(server: Server) -> None:
    tools = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
    body = post(
        server,
        "/v1/responses",
        {
            "input": ASK,
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": MAX_TOKENS,
            "temperature": 0,
            "store": False,
        },
    )
    assert body["status"] == "completed", body
    calls = [item for item in body["output"] if item["type"] == "function_call"]
    assert len(calls) == 1
    check_call(calls[0]["name"], json.loads(calls[0]["arguments"]))
