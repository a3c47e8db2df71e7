"""Deadlines on reading a request (frontend/http_protocol.py), on a real
uvicorn server on loopback with short deadlines and a route that reads its
body. (The API server's default deadlines are exercised end to end in
test_faults.py.)"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from pagoda.frontend.http_protocol import header_timeout_protocol
from tests.frontend.servers import free_port, raw_exchange

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = FastAPI()
    seen: list[int] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        body = await request.body()
        seen.append(len(body))
        return {"bytes": len(body)}

    port = free_port()
    config = uvicorn.Config(
        app,
        port=port,
        log_level="warning",
        http=header_timeout_protocol(HEADER_TIMEOUT, BODY_TIMEOUT),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def exchange(port: int, parts: list[bytes], delay: float) -> tuple[bytes, float]:
    """What came back, and how long until the connection closed (or answered)."""
    started = time.monotonic()
    reply = raw_exchange(port, parts, delay, until=b'"bytes"')
    return reply, time.monotonic() - started


def post(length: int) -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length


def test_trickled_body_gets_408_at_the_deadline(port: int) -> None:
    # 40 bytes promised, one every 0.2 s: 8 s in all, cut at 1.5 s.
    reply, took = exchange(port, [post(40)] + [b"x"] * 40, 0.2)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"body took too long" in reply
    assert BODY_TIMEOUT <= took < BODY_TIMEOUT + 2


def test_body_that_stops_arriving_gets_408(port: int) -> None:
    reply, took = exchange(port, [post(100) + b"only part"], 0.0)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert took < BODY_TIMEOUT + 2


def test_slow_but_timely_body_and_keep_alive_are_served(port: int) -> None:
    # Slower than the header deadline in total, within the body deadline.
    reply, _ = exchange(port, [post(6), b"ab", b"cd", b"ef"], 0.4)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert b'{"bytes":6}' in reply
    # Keep-alive: each request on the connection gets its own body deadline
    # (two slow bodies of 1.2 s each, 2.4 s together, both served).
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        for _ in range(2):
            s.sendall(post(4) + b"ab")
            time.sleep(1.2)
            s.sendall(b"cd")
            data = b""
            while b'"bytes"' not in data and (chunk := s.recv(65536)):
                data += chunk
            assert data.startswith(b"HTTP/1.1 200") and b'{"bytes":4}' in data, data[:200]
            time.sleep(HEADER_TIMEOUT * 0.5)


def test_headers_deadline_still_applies(port: int) -> None:
    reply, took = exchange(port, [b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le"], 0.0)
    assert reply.startswith(b"HTTP/1.1 408") and b"headers took too long" in reply
    assert took < HEADER_TIMEOUT + 2
