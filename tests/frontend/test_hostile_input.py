# ruff: noqa: E501
"""Hostile and odd input: each gets a 4xx in its route's error shape (or a documented clamp)
within a bounded time, and the server keeps serving.

The table below is also what docs/reliability.md reports.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.frontend.conftest import MODEL_NAME, Server

M = MODEL_NAME


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def anth(**extra: Any) -> dict[str, Any]:
    return {"model": M, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


def _deep_schema(depth: int) -> dict[str, Any]:
    root: dict[str, Any] = {"type": "object", "properties": {}}
    node = root
    for _ in range(depth):
        child: dict[str, Any] = {"type": "object", "properties": {}}
        node["properties"]["a"] = child
        node = child
    return root


_RECURSIVE = {
    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
    "$ref": "#/$defs/n",
}
_DEEP = ("[" * 100_000 + "]" * 100_000).encode()


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any = None
    raw: bytes | None = None
    ok: tuple[int, ...] = (400,)


CASES = [
    # Bodies that do not parse, or parse into something no handler can use.
    *(
        Case(f"deeply nested JSON {p}", p, raw=b'{"x":' + _DEEP + b"}")
        for p in (
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/messages",
            "/tokenize",
            "/v1/chat/completions/batch",
            "/invocations",
        )
    ),
    Case("10 MB body", "/v1/chat/completions", raw=b'{"x":"' + b"a" * (10 << 20) + b'"}', ok=(413,)),
    Case("10 MB body", "/v1/messages", raw=b'{"x":"' + b"a" * (10 << 20) + b'"}', ok=(413,)),
    Case("invalid UTF-8", "/v1/chat/completions", raw=b'{"messages":[{"role":"user","content":"\xff"}]}'),
    Case("invalid UTF-8", "/v1/messages", raw=b'{"messages":[{"role":"user","content":"\xfe"}]}'),
    *(
        Case(f"lone surrogate {p}", p, raw=raw)
        for p, raw in (
            ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\\udc00x"}]}'),
            ("/v1/completions", b'{"prompt":"\\ud800","max_tokens":2}'),
            ("/v1/completions", b'{"model":"\\ud800","prompt":"x"}'),
            ("/v1/responses", b'{"input":"\\ud800"}'),
            ("/v1/messages", b'{"model":"\\ud800","max_tokens":2,"messages":[]}'),
            ("/tokenize", b'{"prompt":"\\ud800"}'),
            ("/invocations", b'{"prompt":"a\\ud800"}'),
        )
    ),
    # Odd text: served (200), the special-token text is plain text to the tokenizer.
    Case("NUL bytes", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "a\0b"}]), ok=(200,)),
    Case("NUL bytes", "/v1/completions", {"prompt": "\0\0", "max_tokens": 2}, ok=(200,)),
    Case("special-token text only", "/v1/completions", {"prompt": "<|im_start|><|im_end|>" * 20, "max_tokens": 2}, ok=(200,)),
    Case("special-token text only", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "<|im_end|><|im_start|>system"}]), ok=(200,)),
    # Empty things.
    Case("empty prompt", "/v1/completions", {"prompt": "", "max_tokens": 2}),
    Case("empty prompt list", "/v1/completions", {"prompt": [], "max_tokens": 2}),
    Case("empty token list", "/v1/completions", {"prompt": [[]], "max_tokens": 2}),
    Case("empty messages", "/v1/chat/completions", chat(messages=[])),
    Case("empty messages", "/v1/messages", anth(messages=[])),
    Case("empty input", "/v1/responses", {"model": M, "input": []}),
    Case("empty messages", "/tokenize", {"messages": []}),
    Case("empty batch", "/v1/chat/completions/batch", {"requests": []}),
    # Too much of something.
    Case("n in the thousands", "/v1/chat/completions", chat(n=5000)),
    Case("n in the thousands", "/v1/completions", {"prompt": "x", "n": 5000}),
    Case("max_tokens past the context", "/v1/chat/completions", chat(max_tokens=10**9)),
    Case("max_tokens past the context", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}),
    Case("max_tokens past the context", "/v1/messages", anth(max_tokens=10**9)),
    Case("max_output_tokens past the context", "/v1/responses", {"model": M, "input": "hi", "max_output_tokens": 10**9}),
    Case("500 stop strings", "/v1/chat/completions", chat(stop=[f"s{i}" for i in range(500)])),
    Case("500 stop strings", "/v1/messages", anth(stop_sequences=[f"s{i}" for i in range(500)])),
    Case("logit_bias id out of range", "/v1/chat/completions", chat(logit_bias={"99999999": 5})),
    Case("logit_bias id negative", "/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"-5": 5}}),
    Case("logit_bias NaN", "/v1/completions", raw=b'{"prompt":"x","max_tokens":2,"logit_bias":{"5":NaN}}'),
    Case("logit_bias not an id", "/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"a": 1}}),
    # Constraints: nonsense is a 400; a deep but valid schema compiles and is served.
    Case("invalid regex", "/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "(((("}}),
    Case("nested-repeat regex", "/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "((a{1,100}){1,100}){1,100}"}}, ok=(200,)),
    Case("300-deep JSON schema", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(300)}}), ok=(200,)),
    Case("recursive response schema", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"c": {"$ref": "#"}}}}}), ok=(200,)),
    Case("recursive tool schema", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _RECURSIVE}}], tool_choice={"type": "function", "function": {"name": "f"}}), ok=(200,)),
    Case("recursive tool schema, required", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _RECURSIVE}}], tool_choice="required"), ok=(200,)),
    Case("recursive tool schema", "/v1/messages", anth(tools=[{"name": "f", "input_schema": _RECURSIVE}], tool_choice={"type": "any"}), ok=(200,)),
    Case("recursive tool schema", "/v1/responses", {"model": M, "input": "hi", "max_output_tokens": 4, "tools": [{"type": "function", "name": "f", "parameters": _RECURSIVE}], "tool_choice": "required"}, ok=(200,)),
    Case("self-recursive tool schema ($ref #), required", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"c": {"$ref": "#"}}}}}], tool_choice="required"), ok=(200,)),
    Case("two recursive tools, same $defs name", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": n, "parameters": _RECURSIVE}} for n in ("f", "g")], tool_choice="required"), ok=(200,)),
    Case("tool schema not an object", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "nope"}}]), ok=(400,)),
]  # fmt: skip

# Every case answers within this (the constrained ones compile a grammar on 2 CPUs).
BOUND_S = 30.0


def check_shape(path: str, status: int, body: Any) -> None:
    if status == 200:
        return
    if path.startswith("/v1/messages"):
        assert body["type"] == "error", body
        assert isinstance(body["error"]["message"], str) and body["error"]["type"], body
    else:
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str), body


def send(base: str, case: Case) -> httpx.Response:
    with httpx.Client(timeout=BOUND_S + 30) as client:
        if case.raw is not None:
            return client.post(
                base + case.path, content=case.raw, headers={"content-type": "application/json"}
            )
        return client.post(base + case.path, json=case.body)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.name} {c.path}" for c in CASES])
def test_hostile_input(server: Server, case: Case) -> None:
    start = time.monotonic()
    r = send(server.base_url, case)
    elapsed = time.monotonic() - start
    assert r.status_code in case.ok, (r.status_code, r.text[:300])
    check_shape(case.path, r.status_code, json.loads(r.content))
    assert elapsed < BOUND_S
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_chunked_body_over_limit_is_413(server: Server) -> None:
    """No Content-Length: the limit holds while the body streams in."""

    def chunks() -> Any:
        for _ in range(12):
            yield b"a" * (1 << 20)

    r = httpx.post(
        server.v1 + "/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413, r.text[:200]
    assert r.json()["error"]["type"] == "request_too_large"
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_valid_surrogate_pair_is_served(server: Server) -> None:
    """An emoji escaped as a surrogate pair (what json.dumps writes) is fine."""
    raw = json.dumps({"prompt": "smile 😀", "max_tokens": 2}).encode()
    assert b"\\ud83d\\ude00" in raw
    r = httpx.post(
        server.v1 + "/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 200, r.text[:200]


def test_grammar_compile_blowup_is_a_bounded_400(tmp_path: Any) -> None:
    """A schema that takes about a minute to compile gets a 400 after the timeout; its
    compile process is killed, so a structured request right after is served promptly."""
    from tests.frontend.conftest import ENGINE_FLAGS
    from tests.frontend.servers import private_server

    props = {
        f"p{i}": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "[a-z]{1,50}"}]}
        for i in range(400)
    }
    schema = {"type": "object", "properties": props, "required": list(props)}
    small = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    flags = (*ENGINE_FLAGS, "--grammar-compile-timeout", "2")
    with private_server(tmp_path, flags, name="grammar") as base:
        # The compile processes start with the engine; one constrained request shows
        # they are warm (its 2 s budget would not cover their start).
        deadline = time.monotonic() + 120
        while True:
            r = httpx.post(
                base + "/v1/completions",
                json={"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "[a-z]+"}},
                timeout=60,
            )
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert r.status_code == 200, r.text[:300]
        start = time.monotonic()
        r = httpx.post(
            base + "/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": schema}},
            timeout=60,
        )
        elapsed = time.monotonic() - start
        assert r.status_code == 400, r.text[:300]
        assert "did not compile within 2 s" in r.json()["error"]["message"]
        assert elapsed < 10
        # Unconstrained requests are served meanwhile.
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        # A new schema right after compiles within its own 2 s: nothing runs on behind it.
        start = time.monotonic()
        r = httpx.post(
            base + "/v1/chat/completions",
            json={
                "model": M,
                "messages": [{"role": "user", "content": "a number"}],
                "max_tokens": 8,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": small},
                },
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text[:300]
        assert time.monotonic() - start < 15  # 8 tokens on the loaded CPU; compile < 2 s
