"""The middlewares cover WebSocket handshakes: a route added to the real app
gets the key checks, draining and the message-size guard with no code of its own.

The app is built by `build_app` on an AsyncLLM whose client never reaches an
engine: every check here runs before a route does. Starlette's TestClient
offers ASGI's denial-response extension (as uvicorn does), so a refused
handshake is the HTTP error response; without the extension it is a close
before accept (code 1008 or 1013).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from starlette.testclient import TestClient, WebSocketDenialResponse

from pagoda.frontend.api.app import FrontendConfig, build_app
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.protocol.messages import PROTOCOL_VERSION, Ready, SchedulerStats

ECHO = "/v1/test/ws"
ADMIN_ECHO = "/v1/loras/test-ws"  # under /v1/loras: an admin path


class NoEngineClient:
    """An engine client that was told what the engine serves and never sends anything."""

    def __init__(self) -> None:
        self.ready = Ready(
            "test", PROTOCOL_VERSION, "test-model", "/none", "/none", 512, 1000, 16, 64, [0],
            ["generate"],
        )  # fmt: skip
        self.stats = SchedulerStats()
        self.dead: str | None = None


def app_with_echo(**config: Any) -> FastAPI:
    """The real app, plus a WebSocket echo route at ECHO and ADMIN_ECHO."""
    engine = AsyncLLM(NoEngineClient(), tokenizer=None)  # type: ignore[arg-type]
    app = build_app(engine, FrontendConfig(**config))

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            while True:
                await websocket.send_text(await websocket.receive_text())
        except WebSocketDisconnect:
            return

    app.add_api_websocket_route(ECHO, echo)
    app.add_api_websocket_route(ADMIN_ECHO, echo)
    return app


def echoes(client: TestClient, path: str, headers: dict[str, str] | None = None) -> bool:
    """Whether the handshake is accepted and the route answers."""
    with client.websocket_connect(path, headers=dict(headers or {})) as ws:
        ws.send_text("hello")
        return ws.receive_text() == "hello"


def denial(client: TestClient, path: str, headers: dict[str, str] | None = None) -> Any:
    with pytest.raises(WebSocketDenialResponse) as refused:
        with client.websocket_connect(path, headers=dict(headers or {})):
            pass
    return refused.value


def test_open_without_keys_and_request_id_on_accept() -> None:
    client = TestClient(app_with_echo())
    assert echoes(client, ECHO)
    with client.websocket_connect(ECHO, headers={"X-Request-Id": "abc"}) as ws:
        assert (b"x-request-id", b"abc") in (ws.extra_headers or [])


def test_api_key_checked_on_the_handshake() -> None:
    client = TestClient(app_with_echo(api_keys=("sesame",)))
    refused = denial(client, ECHO)
    assert refused.status_code == 401
    assert refused.json()["error"]["message"] == "invalid or missing API key"
    assert denial(client, ECHO, {"Authorization": "Bearer wrong"}).status_code == 401
    assert echoes(client, ECHO, {"Authorization": "Bearer sesame"})
    assert echoes(client, ECHO, {"X-API-Key": "sesame"})


def test_admin_key_alone_opens_an_admin_path() -> None:
    client = TestClient(app_with_echo(api_keys=("sesame",), admin_api_key="admin-secret"))
    refused = denial(client, ADMIN_ECHO, {"Authorization": "Bearer sesame"})
    assert refused.status_code == 401 and "admin" in refused.json()["error"]["message"]
    assert denial(client, ADMIN_ECHO).status_code == 401
    assert echoes(client, ADMIN_ECHO, {"Authorization": "Bearer admin-secret"})
    # The admin key is not an API key.
    assert denial(client, ECHO, {"Authorization": "Bearer admin-secret"}).status_code == 401
    assert echoes(client, ECHO, {"Authorization": "Bearer sesame"})


def test_draining_refuses_new_handshakes() -> None:
    app = app_with_echo()
    client = TestClient(app)
    assert echoes(client, ECHO)
    assert asyncio.run(app.state.drain(0.0)) == 0
    refused = denial(client, ECHO)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert client.get("/load").json() == {"server_load": 0}  # still open


def test_oversized_message_closes_with_1009() -> None:
    client = TestClient(app_with_echo(max_request_body_bytes=64))
    with client.websocket_connect(ECHO) as ws:
        ws.send_text("x" * 64)
        assert ws.receive_text() == "x" * 64
        ws.send_text("x" * 65)
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 1009


@pytest.mark.parametrize(
    ("config", "headers", "code"),
    [
        ({"api_keys": ("sesame",)}, [], 1008),
        ({"api_keys": ("sesame",)}, [(b"authorization", b"Bearer sesame")], None),
    ],
)
def test_close_before_accept_without_the_denial_extension(
    config: dict[str, Any], headers: list[tuple[bytes, bytes]], code: int | None
) -> None:
    """A server that lacks "websocket.http.response" gets a close before accept."""
    app = app_with_echo(**config)
    scope = {
        "type": "websocket",
        "asgi": {"version": "3.0"},
        "scheme": "ws",
        "path": ECHO,
        "raw_path": ECHO.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
        "subprotocols": [],
        "extensions": {},
    }
    incoming = [{"type": "websocket.connect"}, {"type": "websocket.disconnect", "code": 1000}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "websocket.disconnect", "code": 1000}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    if code is None:
        assert sent[0]["type"] == "websocket.accept"
    else:
        assert sent == [{"type": "websocket.close", "code": code, "reason": ""}]
