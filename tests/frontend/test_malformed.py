"""A table of malformed requests over the generation API: each is a 4xx in the route's
own error shape, none is a 5xx, and the server keeps serving after all of them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.frontend.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow

M = MODEL_NAME
USER = [{"role": "user", "content": "hi"}]
GARBAGE = "\udcff\x00\ufffe\U0010ffff" * 4  # lone surrogate, NUL, non-characters
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (route, body); bodies are sent as JSON text, or raw bytes when `bytes`.
CASES: list[tuple[str, Any]] = [
    # wrong types
    ("/v1/chat/completions", {"model": M, "messages": "hi"}),
    ("/v1/chat/completions", {"model": M, "messages": USER, "max_tokens": "ten"}),
    ("/v1/chat/completions", {"model": M, "messages": USER, "temperature": [1]}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": 5, "content": "x"}]}),
    ("/v1/completions", {"model": M, "prompt": {"text": "x"}}),
    ("/v1/completions", {"model": M, "prompt": [[1, "a"]]}),
    ("/v1/completions", {"model": M, "prompt": "x", "stop": 7}),
    ("/v1/responses", {"model": M, "input": {"role": "user"}}),
    ("/v1/messages", {"model": M, "max_tokens": "five", "messages": USER}),
    ("/tokenize", {"model": M, "prompt": 12}),
    ("/detokenize", {"model": M, "tokens": "abc"}),
    # missing fields
    ("/v1/chat/completions", {"model": M}),
    ("/v1/completions", {"model": M}),
    ("/v1/messages", {"model": M, "max_tokens": 5}),
    ("/v1/messages/count_tokens", {"model": M}),
    ("/v1/chat/completions/render", {"model": M}),
    ("/v1/chat/completions", {"model": M, "messages": [{"content": "no role"}]}),
    # absurd sizes
    ("/v1/chat/completions", {"model": M, "messages": USER, "n": 100000}),
    ("/v1/chat/completions", {"model": M, "messages": USER, "max_tokens": 10**12}),
    ("/v1/completions", {"model": M, "prompt": "x", "logprobs": 10**6}),
    ("/v1/completions", {"model": M, "prompt": [10**9]}),
    ("/v1/completions", {"model": M, "prompt": "x", "stop": ["s"] * 100000}),
    ("/v1/completions", {"model": M, "prompt": "word " * 5000}),
    ("/v1/chat/completions", {"model": M, "messages": USER, "seed": 10**30}),
    # integers past 64 bits that used to reach the engine socket's encoder (500)
    ("/v1/chat/completions", {"model": M, "messages": USER, "priority": 2**64 + 5}),
    ("/v1/completions", {"model": M, "prompt": "x", "priority": -(2**70)}),
    ("/v1/chat/completions", {"model": M, "messages": USER, "top_k": 2**64 + 5}),
    ("/v1/responses", {"model": M, "input": "x", "top_k": 2**65}),
    ("/v1/responses", {"model": M, "input": "x", "priority": 2**65}),
    ("/v1/responses", {"model": M, "input": "x", "max_output_tokens": -1}),
    ("/v1/messages", {"model": M, "max_tokens": 10**9, "messages": USER}),
    ("/detokenize", {"model": M, "tokens": [-5]}),
    # unknown tool names and inconsistent tools
    (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": USER,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
    ),
    ("/v1/chat/completions", {"model": M, "messages": USER, "tool_choice": "required"}),
    ("/v1/chat/completions", {"model": M, "messages": USER, "tools": [{"type": "robot"}]}),
    ("/v1/responses", {"model": M, "input": "x", "tools": [{"type": "function"}]}),
    (
        "/v1/messages",
        {
            "model": M,
            "max_tokens": 5,
            "messages": USER,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "g"},
        },
    ),
    # bad schemas, regexes and grammars
    (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": 3}},
        },
    ),
    (
        "/v1/chat/completions",
        {"model": M, "messages": USER, "structured_outputs": {"regex": "(unclosed"}},
    ),
    (
        "/v1/completions",
        {"model": M, "prompt": "x", "structured_outputs": {"grammar": "root ::= ("}},
    ),
    ("/v1/completions", {"model": M, "prompt": "x", "structured_outputs": {"choice": []}}),
    ("/v1/chat/completions", {"model": M, "messages": USER, "response_format": {"type": "xml"}}),
    (
        "/v1/responses",
        {
            "model": M,
            "input": "x",
            "text": {
                "format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}
            },
        },
    ),
    # unicode garbage and broken bodies
    ("/v1/chat/completions", b'{"model": "' + M.encode() + b'", "messages": [\xff\xfe]}'),
    ("/v1/completions", b"\x00\x01\x02"),
    ("/v1/completions", b'{"model": "m", "prompt": "x"'),
    ("/v1/messages", b"[]"),
    ("/v1/responses", b"null"),
    ("/v1/chat/completions", {"model": M, "messages": USER, "logit_bias": {GARBAGE: 1}}),
    ("/v1/chat/completions", {"model": GARBAGE, "messages": USER}),
    ("/tokenize", {"model": M, "messages": [{"role": GARBAGE, "content": "x"}]}),
    ("/v1/chat/completions/batch", {"requests": [{"model": M}] * 2000}),
    ("/invocations", {"neither": True}),
]


def _post(server: Server, route: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        content = body
    else:  # lone surrogates are not valid UTF-8: send them as JSON escapes
        content = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(server.base_url + route, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize(("route", "body"), CASES, ids=[f"{i}:{c[0]}" for i, c in enumerate(CASES)])
def test_malformed_is_4xx_in_the_route_shape(server: Server, route: str, body: Any) -> None:
    r = _post(server, route, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    payload = r.json()
    if route.startswith("/v1/messages"):
        assert payload["type"] == "error" and payload["error"]["message"]
    else:
        assert payload["error"]["message"] and payload["error"]["type"]


def test_server_still_serves_after_the_table(server: Server) -> None:
    for route, body in CASES[:5]:
        _post(server, route, body)
    r = httpx.post(
        server.v1 + "/chat/completions",
        json={"model": M, "messages": USER, "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    stats = httpx.get(server.base_url + "/stats", timeout=30).json()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
