"""An ASGI guard on request bodies, run before any route parses them.

Two things no route can check well once the body is parsed:

- size: a body over the limit is refused with 413 while it streams in, also
  when it comes chunked without a Content-Length;
- lone UTF-16 surrogates (``"\\ud800"``): JSON allows the escape, Python
  decodes it into a str that the tokenizer and the UTF-8 response encoder then
  reject deep inside a handler. They are refused here with a 400 instead.

The error is in the shape of the API the path belongs to. On a WebSocket
the same two checks apply to each message the client sends: one over
`max_bytes` closes the connection with 1009 (message too big), a text
message with a lone surrogate escape with 1007 (invalid payload); the route
then receives a disconnect.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pagoda.frontend.api.errors import APIError, anthropic_error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Any JSON escape, so that "\\\\ud800" (an escaped backslash, then text) is
# told apart from "\\ud800" (a surrogate escape).
_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.S)
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
MESSAGE_TOO_BIG = 1009
INVALID_PAYLOAD = 1007


def has_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON text holds a \\uD800-\\uDFFF escape not part of a valid pair."""
    if not _MAYBE_SURROGATE.search(body):
        return False
    pending_high_end = -1  # where the last unpaired high surrogate escape ended
    for m in _ESCAPE.finditer(body):
        code = int(m.group(1), 16) if m.group(1) else None
        if pending_high_end >= 0:
            if m.start() != pending_high_end or code is None or not 0xDC00 <= code <= 0xDFFF:
                return True
            pending_high_end = -1
            continue
        if code is None:
            continue
        if 0xD800 <= code <= 0xDBFF:
            pending_high_end = m.end()
        elif 0xDC00 <= code <= 0xDFFF:
            return True
    return pending_high_end >= 0


class BodyGuard:
    """Buffers each request body (up to `max_bytes`), checks it, then replays it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self.app(scope, self._guard_messages(receive, send), send)
            return
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                # The client left (or the body deadline closed the connection)
                # before the body was complete. Nobody reads this answer, but
                # the middlewares above expect one and would log an error.
                await self._refuse(scope, send, APIError(408, "the request body did not arrive"))
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(
                    scope, send, APIError(413, f"request body over {self.max_bytes} bytes")
                )
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if has_lone_surrogate(body):
            await self._refuse(
                scope,
                send,
                APIError(400, "the request body holds a lone UTF-16 surrogate escape"),
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)

    def _guard_messages(self, receive: Receive, send: Send) -> Receive:
        """`receive` for a WebSocket route: each message checked as a body would be."""

        async def guarded() -> Message:
            message = await receive()
            if message["type"] != "websocket.receive":
                return message
            text = message.get("text")
            data: bytes = text.encode("utf-8", "surrogatepass") if text is not None else b""
            data = data or message.get("bytes") or b""
            code = None
            if len(data) > self.max_bytes:
                code = MESSAGE_TOO_BIG
            elif text is not None and has_lone_surrogate(data):
                code = INVALID_PAYLOAD
            if code is None:
                return message
            await send({"type": "websocket.close", "code": code, "reason": ""})
            return {"type": "websocket.disconnect", "code": code}

        return guarded

    @staticmethod
    async def _refuse(scope: Scope, send: Send, err: APIError) -> None:
        path: str = scope.get("path", "")
        response = anthropic_error_body(err) if path.startswith("/v1/messages") else err.body()
        payload = json.dumps(response).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
