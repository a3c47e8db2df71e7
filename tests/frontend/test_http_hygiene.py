"""CORS (closed by default), X-Request-Id, and the request body size limit."""

from __future__ import annotations

import httpx
import pytest

from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME, Server
from tests.frontend.servers import (
    private_server,
)

pytestmark = pytest.mark.slow

PREFLIGHT = {
    "Origin": "http://app.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_cors_closed_by_default_request_id_and_413(server: Server) -> None:
    r = httpx.options(server.v1 + "/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.v1 + "/models", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    generated = httpx.get(server.v1 + "/models").headers["x-request-id"]
    assert len(generated) >= 16
    big = b'{"model": "m", "prompt": "' + b"a" * (9 << 20) + b'"}'
    r = httpx.post(
        server.v1 + "/completions",
        content=big,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert len(r.headers["x-request-id"]) >= 16  # refused before the app: still an id
    # A streamed response carries it too (the header goes out with the first chunk).
    with httpx.stream(
        "POST",
        server.v1 + "/completions",
        json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 3, "stream": True},
        headers={"X-Request-Id": "stream-7"},
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "stream-7"
        assert "data: [DONE]" in streamed.read().decode()
    r = httpx.post(
        server.base_url + "/v1/messages",
        content=big,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["type"] == "error"
    # still serving
    ok = httpx.post(
        server.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 1}
    )
    assert ok.status_code == 200


def test_cors_open_for_allowed_origins_and_preflight_needs_no_key(tmp_path: object) -> None:
    with private_server(
        tmp_path,
        ENGINE_FLAGS,
        "--allowed-origins",
        '["http://app.example"]',
        "--api-key",
        "k",
        name="cors",
    ) as base:
        r = httpx.options(base + "/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.options(
            base + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"}
        )
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"
        r = httpx.get(base + "/v1/models", headers={"Origin": "http://app.example"})
        assert r.status_code == 401
