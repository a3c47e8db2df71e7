"""The API server's two outer middlewares, as plain ASGI.

Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) relays every
chunk of a streamed response through a memory stream and a task switch; with
two such layers that was about a third of the API server's CPU time while it
streamed tokens, CPU the engine core on the same cores then lacked. These
look at the request's headers and the response's start only, and pass the
body through untouched.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request

from pagoda.frontend.api.body_guard import ASGIApp, Message, Receive, Scope, Send
from pagoda.frontend.api.common import unavailable
from pagoda.frontend.api.errors import APIError, error_response


class RequestIdAndSize:
    """Echoes the request's X-Request-Id (or a new one) on the response, and
    refuses a body whose Content-Length is over `max_bytes` before it is read
    (BodyGuard, further in, also catches bodies that come without one)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = (headers.get("x-request-id") or uuid.uuid4().hex)[:128]
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            response = error_response(
                Request(scope), APIError(413, f"request body over {self.max_bytes} bytes")
            )
            response.headers["X-Request-Id"] = request_id
            await response(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class RefuseWhileDraining:
    """While `draining()` holds, answers 503 to every path but `open_paths`."""

    def __init__(
        self, app: ASGIApp, draining: Callable[[], bool], open_paths: Collection[str]
    ) -> None:
        self.app = app
        self.draining = draining
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.draining():
            request = Request(scope)
            if request.url.path not in self.open_paths:
                response = error_response(request, unavailable("the server is shutting down"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
