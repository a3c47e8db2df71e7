"""`cache_salt` on the generation routes: cached prefixes shared only under the same salt."""

from __future__ import annotations

import re
import time
import uuid

import httpx

from tests.frontend.conftest import MODEL_NAME, Server


def prefix_hits(server: Server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    match = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
    assert match, "no prefix-cache hit counter"
    return float(match.group(1))


def hits_of(server: Server, route: str, body: dict[str, object]) -> float:
    """Prefix-cache hits (tokens) this one request added (the suite's other
    tests do not run at the same time)."""
    before = prefix_hits(server)
    r = httpx.post(server.v1 + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    time.sleep(0.3)  # the stats ride on the next outputs
    return prefix_hits(server) - before


def test_cache_salt_on_completions_and_chat(server: Server) -> None:
    text = f"{uuid.uuid4()} " + "the quick brown fox jumps over the lazy dog " * 6
    completion = {"model": MODEL_NAME, "prompt": text, "max_tokens": 2, "temperature": 0}
    assert hits_of(server, "/completions", {**completion, "cache_salt": "a"}) == 0
    assert hits_of(server, "/completions", {**completion, "cache_salt": "b"}) == 0
    assert hits_of(server, "/completions", {**completion, "cache_salt": "a"}) >= 32
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": text + " again"}],
        "max_tokens": 2,
    }
    assert hits_of(server, "/chat/completions", {**chat, "cache_salt": "c"}) == 0
    assert hits_of(server, "/chat/completions", {**chat, "cache_salt": "d"}) == 0
    assert hits_of(server, "/chat/completions", {**chat, "cache_salt": "c"}) >= 32
    for bad in ("", 3, ["x"]):
        r = httpx.post(server.v1 + "/completions", json={**completion, "cache_salt": bad})
        assert r.status_code == 400 and "cache_salt" in r.text, r.text
