"""Who may call what: the API-key and admin-key checks run before every route.

With --api-key set, every route but the open ones (/health, /ping, /version,
unless --metrics-require-auth /metrics, and the static files of the web UI
and the docs pages, each by its exact path) needs one of the keys, as a
bearer token or in X-API-Key (a WebSocket handshake may carry it as the
subprotocol `openai-insecure-api-key.<key>`, as browsers must). With
--admin-api-key set, the engine-control and LoRA-admin routes need that key
and only it: an API key is not enough.
Keys are compared in constant time. CORS preflights (OPTIONS) pass through.
WebSocket handshakes are checked the same way, by path, and refused before
they are accepted (see `middleware.refuse`).
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.requests import HTTPConnection

from pagoda.frontend.api.body_guard import ASGIApp, Receive, Scope, Send
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.middleware import POLICY_VIOLATION, refuse
from pagoda.frontend.api.serving_rl import RL_PATHS

# A browser's WebSocket carries its key in this subprotocol (OpenAI's realtime clients).
API_KEY_SUBPROTOCOL = "openai-insecure-api-key."
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
# Engine-control routes: when --admin-api-key is set they need it (and not --api-key).
ADMIN_PATHS = frozenset(
    {
        "/collective_rpc",
        "/sleep",
        "/wake_up",
        "/wake-up",
        "/reset_prefix_cache",
        "/reset-prefix-cache",
        "/start_profile",
        "/start-profile",
        "/stop_profile",
        "/stop-profile",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/scale_elastic_ep",
    }
)


def is_admin_path(path: str) -> bool:
    """Whether `path` is an admin route (the admin key guards it when one is set)."""
    return path in ADMIN_PATHS or path in RL_PATHS or path.startswith("/v1/loras")


def request_token(request: HTTPConnection) -> bytes:
    """The key a request carries: its bearer token, else its X-API-Key header,
    else (a WebSocket from a browser, which cannot set headers) the subprotocol
    `openai-insecure-api-key.<key>`, as OpenAI's realtime clients send it."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].encode()
    if "x-api-key" in request.headers:
        return request.headers["x-api-key"].encode()
    if request.scope["type"] != "websocket":
        return b""
    for protocol in request.headers.get("sec-websocket-protocol", "").split(","):
        if protocol.strip().startswith(API_KEY_SUBPROTOCOL):
            return protocol.strip()[len(API_KEY_SUBPROTOCOL) :].encode()
    return b""


def install_auth(
    app: FastAPI,
    api_keys: tuple[str, ...],
    admin_api_key: str | None,
    metrics_require_auth: bool,
    static_paths: frozenset[str] = frozenset(),
) -> None:
    """Add the key-checking middleware to `app`; nothing when no key is configured.

    `static_paths` are the exact paths of pages and assets that hold no data
    (the web UI's, the docs'): they load without a key, and the API calls they
    make carry one.
    """
    if not api_keys and not admin_api_key:
        return
    keys = [k.encode() for k in api_keys]
    admin_key = admin_api_key.encode() if admin_api_key else None
    open_paths = (OPEN_PATHS - ({"/metrics"} if metrics_require_auth else set())) | static_paths

    app.add_middleware(KeyCheck, keys=keys, admin_key=admin_key, open_paths=open_paths)


class KeyCheck:
    """The key checks as plain ASGI, for HTTP and WebSocket scopes (see
    frontend/api/middleware.py for why)."""

    def __init__(
        self, app: ASGIApp, keys: list[bytes], admin_key: bytes | None, open_paths: frozenset[str]
    ) -> None:
        self.app = app
        self.keys = keys
        self.admin_key = admin_key
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            error = self.refusal(HTTPConnection(scope))
            if error is not None:
                await refuse(scope, receive, send, error, POLICY_VIOLATION)
                return
        await self.app(scope, receive, send)

    def refusal(self, connection: HTTPConnection) -> APIError | None:
        path = connection.url.path
        if connection.scope.get("method") == "OPTIONS" or path in self.open_paths:
            return None
        token = request_token(connection)
        if self.admin_key is not None and is_admin_path(path):
            # Constant-time, and the admin key only: an API key is not enough here.
            if not hmac.compare_digest(token, self.admin_key):
                return APIError(401, "invalid or missing admin key")
        elif self.keys and not any(hmac.compare_digest(token, k) for k in self.keys):
            return APIError(401, "invalid or missing API key")
        return None
