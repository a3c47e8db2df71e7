"""The API server's outer middlewares, as plain ASGI, for HTTP and WebSocket scopes.

Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) relays every
chunk of a streamed response through a memory stream and a task switch; with
two such layers that was about a third of the API server's CPU time while it
streamed tokens, CPU the engine core on the same cores then lacked. It also
never sees a WebSocket. These look at the request's headers and the
response's start only, and pass the body through untouched.

A WebSocket handshake is refused before it is accepted, by `refuse`: with
the same error response an HTTP request gets (status and JSON body), sent as
a denial response (ASGI's "websocket.http.response" extension, which uvicorn
and Starlette's TestClient offer), or, on a server without that extension,
by closing before accept with a close code (uvicorn then answers the
handshake with HTTP 403). A route added later gets all of this without code
of its own. (uvicorn serves WebSockets only with the `websockets` or
`wsproto` package installed.)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import HTTPConnection

from pagoda.frontend.api.body_guard import ASGIApp, Message, Receive, Scope, Send
from pagoda.frontend.api.common import unavailable
from pagoda.frontend.api.errors import APIError, error_response

# RFC 6455 close codes for a handshake refused on a server without denial responses.
POLICY_VIOLATION = 1008  # a missing or wrong key
TRY_AGAIN_LATER = 1013  # draining


async def refuse(
    scope: Scope, receive: Receive, send: Send, err: APIError, close_code: int
) -> None:
    """Answer `err` in place of the app: an error response, or a refused handshake."""
    response = error_response(HTTPConnection(scope), err)
    if scope["type"] == "websocket":
        # The server announces the handshake first; the answer comes after it.
        if (await receive())["type"] != "websocket.connect":
            return  # the client left
        if "websocket.http.response" not in (scope.get("extensions") or {}):
            await send({"type": "websocket.close", "code": close_code, "reason": ""})
            return
    # Starlette sends a response in a WebSocket scope as the denial response.
    await response(scope, receive, send)


class RequestIdAndSize:
    """Echoes the request's X-Request-Id (or a new one) on the response (or on
    the WebSocket's accept), and refuses a body whose Content-Length is over
    `max_bytes` before it is read (BodyGuard, further in, also catches bodies
    that come without one)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = (headers.get("x-request-id") or uuid.uuid4().hex)[:128]
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            err = APIError(
                413,
                f"request body over {self.max_bytes} bytes",
                headers={"X-Request-Id": request_id},
            )
            await refuse(scope, receive, send, err, POLICY_VIOLATION)
            return

        async def send_with_id(message: Message) -> None:
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            elif kind == "websocket.accept":
                id_header = (b"x-request-id", request_id.encode())
                message["headers"] = [*message.get("headers", ()), id_header]
            await send(message)

        await self.app(scope, receive, send_with_id)


class RefuseWhileDraining:
    """While `draining()` holds, answers 503 to every path but `open_paths`, and
    refuses every new WebSocket handshake."""

    def __init__(
        self, app: ASGIApp, draining: Callable[[], bool], open_paths: Collection[str]
    ) -> None:
        self.app = app
        self.draining = draining
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] in ("http", "websocket")
            and self.draining()
            and (
                scope["type"] == "websocket"
                or HTTPConnection(scope).url.path not in self.open_paths
            )
        ):
            err = unavailable("the server is shutting down")
            await refuse(scope, receive, send, err, TRY_AGAIN_LATER)
            return
        await self.app(scope, receive, send)
