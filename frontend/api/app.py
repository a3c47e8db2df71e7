"""The FastAPI application of one API server, built on an AsyncLLM.

Routes follow the tasks the engine's Ready lists: generation routes for
"generate", the pooling routes (embeddings, pooling, score, rerank) for
"embed". The routes of a task the model lacks answer 400 naming its tasks.
The engine-control routes live in `serving_admin.py`, the key checks in
`security.py`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from pagoda.frontend.api.body_guard import BodyGuard
from pagoda.frontend.api.common import as_api_error, unavailable
from pagoda.frontend.api.errors import (
    APIError,
    error_response,
    install_error_handlers,
    read_json,
    validation_api_error,
)
from pagoda.frontend.api.mcp_tools import ToolServer
from pagoda.frontend.api.middleware import RefuseWhileDraining, RequestIdAndSize
from pagoda.frontend.api.openai_models import ChatCompletionRequest, CompletionRequest
from pagoda.frontend.api.security import install_auth
from pagoda.frontend.api.serving_admin import build_router as build_admin_router
from pagoda.frontend.api.serving_anthropic import build_router as build_anthropic_router
from pagoda.frontend.api.serving_chat import ChatServer
from pagoda.frontend.api.serving_completion import CompletionServer
from pagoda.frontend.api.serving_lora import build_router as build_lora_router
from pagoda.frontend.api.serving_models import VERSION
from pagoda.frontend.api.serving_models import build_router as build_models_router
from pagoda.frontend.api.serving_pooling import POOLING_PATHS, EmbeddingRequest, PoolingServer
from pagoda.frontend.api.serving_pooling import build_router as build_pooling_router
from pagoda.frontend.api.serving_responses import build_router as build_responses_router
from pagoda.frontend.api.serving_tokenize import build_router as build_tokenize_router
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.metrics import EngineStatsCollector, FrontendMetrics

_CHAT_REF = {"$ref": "#/components/schemas/ChatCompletionRequest"}
_BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"requests": {"type": "array", "items": _CHAT_REF}},
                    "required": ["requests"],
                }
            }
        },
    }
}
_INVOCATIONS_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {"anyOf": [_CHAT_REF, {"$ref": "#/components/schemas/CompletionRequest"}]}
            }
        },
    }
}


@dataclass(frozen=True)
class FrontendConfig:
    """Settings of one API server, built once from the command line."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None
    chat_template: str | None = None
    # CORS is closed unless origins are given.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    max_request_body_bytes: int = 8 << 20
    # Set only with --enable-auto-tool-choice: tool_choice "auto" is refused without it.
    tool_call_parser: str | None = None
    enable_admin_api: bool = False  # POST /collective_rpc
    admin_api_key: str | None = None
    # Generation requests in flight in this API server beyond which new ones get 503.
    max_inflight_requests: int | None = None
    # /metrics is open (scrapers rarely carry keys) unless this is set.
    metrics_require_auth: bool = False


def build_app(
    engine: AsyncLLM, config: FrontendConfig, tool_servers: dict[str, ToolServer] | None = None
) -> FastAPI:
    """The API server's routes; `tool_servers` are the resolved --tool-server MCP servers."""
    app = FastAPI(title="Pagoda", version=VERSION)
    install_error_handlers(app)
    # Innermost middleware: runs after auth, before any route parses the body.
    app.add_middleware(BodyGuard, max_bytes=config.max_request_body_bytes)
    served = [config.served_model_name or engine.model_name]
    completions = CompletionServer(engine, served)
    chat = ChatServer(engine, served, config.tool_call_parser)
    app.state.engine = engine
    metrics = FrontendMetrics(served[0])
    metrics.add_engine_collector(
        EngineStatsCollector(
            engine.client, served[0], engine.ready.block_size, engine.ready.num_kv_blocks
        )
    )
    engine.metrics = metrics
    tasks = list(engine.ready.supported_tasks)
    pooling = PoolingServer(engine, served) if "embed" in tasks else None

    def unsupported(task: str) -> APIError:
        return APIError(
            400, f"The model `{served[0]}` does not support the {task!r} task; it supports {tasks}"
        )

    install_auth(app, config.api_keys, config.admin_api_key, config.metrics_require_auth)

    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=False,
        )

    # Outermost but one: X-Request-Id, oversized bodies refused up front.
    app.add_middleware(RequestIdAndSize, max_bytes=config.max_request_body_bytes)

    async def guarded(work: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await work()
        except Exception as e:  # noqa: BLE001 - every failure gets the API's error shape
            return as_api_error(e).response()

    in_flight = {"count": 0}
    app.state.draining = False

    async def counted(
        work: Callable[[], Awaitable[Any]],
        shape: Callable[[APIError], Response] = APIError.response,
    ) -> Any:
        # GET /load reports this (vLLM's server load tracking); a streamed
        # response counts until its last event is sent. `shape` renders a
        # refusal in the route's own error format.
        limit = config.max_inflight_requests
        if limit is not None and in_flight["count"] >= limit:
            return shape(
                unavailable(
                    f"the server is overloaded: {limit} requests are in flight; retry later"
                )
            )
        in_flight["count"] += 1
        handed_off = False
        try:
            result = await guarded(work)
            if isinstance(result, StreamingResponse):
                result.body_iterator = _count_until_done(result.body_iterator)
                handed_off = True
            return result
        finally:
            if not handed_off:
                in_flight["count"] -= 1

    async def _count_until_done(body: AsyncIterable[Any]) -> AsyncIterator[Any]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            in_flight["count"] -= 1

    async def drain(timeout: float) -> int:
        """Refuse new requests (503), let in-flight ones finish up to `timeout`, abort the rest.

        Returns how many requests were aborted.
        """
        app.state.draining = True
        deadline = time.monotonic() + timeout
        while (in_flight["count"] or engine.num_active) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        aborted = await engine.abort_all()
        # Let the aborted responses be written before the server closes connections.
        deadline = time.monotonic() + 2.0
        while in_flight["count"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return aborted

    app.state.drain = drain

    app.add_middleware(
        RefuseWhileDraining,
        draining=lambda: app.state.draining,
        open_paths=("/metrics", "/load", "/version"),
    )

    def generating(work: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
        if "generate" not in tasks:
            raise unsupported("generate")
        return counted(work)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Any:
        return await generating(lambda: completions.create(body, request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        return await generating(lambda: chat.create(body, request))

    # These two read their bodies themselves; the schema still says what they take.
    @app.post("/v1/chat/completions/batch", openapi_extra=_BATCH_BODY)
    async def create_chat_batch(request: Request) -> Any:
        """A list of chat requests, answered in order; one failure fails only itself."""
        if "generate" not in tasks:
            raise unsupported("generate")
        body = await read_json(request)
        items = body.get("requests") if isinstance(body, dict) else body
        if not isinstance(items, list) or not items:
            raise APIError(400, "expected a non-empty list of chat requests", "requests")
        if len(items) > 1024:
            raise APIError(400, "at most 1024 requests per batch", "requests")

        async def one(index: int, item: Any) -> dict[str, Any]:
            try:
                req = ChatCompletionRequest.model_validate(item)
                if req.stream:
                    raise APIError(400, "stream is not allowed in a batch", "stream")
                result = await chat.create(req, request)
            except ValidationError as e:
                err = validation_api_error(e)
                return {"index": index, "status": err.status, **err.body()}
            except Exception as e:  # noqa: BLE001 - reported in this item's slot
                err = as_api_error(e)
                return {"index": index, "status": err.status, **err.body()}
            payload = json.loads(bytes(result.body)) if isinstance(result, Response) else result
            return {"index": index, "status": 200, "response": payload}

        results = await counted(lambda: asyncio.gather(*(one(i, x) for i, x in enumerate(items))))
        return {"object": "list", "data": results}

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": in_flight["count"]}

    @app.post("/invocations", openapi_extra=_INVOCATIONS_BODY)
    async def invocations(request: Request) -> Any:
        """SageMaker: dispatch by the body's shape to chat or completions."""
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            if "messages" in body:
                chat_req = ChatCompletionRequest.model_validate(body)
                return await generating(lambda: chat.create(chat_req, request))
            if "prompt" in body:
                comp_req = CompletionRequest.model_validate(body)
                return await generating(lambda: completions.create(comp_req, request))
            if "input" in body and pooling is not None:
                embed_req = EmbeddingRequest.model_validate(body)
                return await counted(lambda: pooling.embeddings(embed_req, request))
        except ValidationError as e:
            raise validation_api_error(e) from None
        raise APIError(
            400, "expected a chat (messages), completions (prompt) or embeddings (input) body"
        )

    app.include_router(build_models_router(engine, served))
    app.include_router(build_tokenize_router(engine, served, chat))
    if engine.ready.enable_lora:
        app.include_router(build_lora_router(engine, served))
    if "generate" in tasks:
        app.include_router(build_anthropic_router(engine, served, chat, counted))
        app.include_router(build_responses_router(engine, served, chat, generating, tool_servers))
    if pooling is not None:
        app.include_router(build_pooling_router(pooling, counted))

    async def refuse_generate(request: Request) -> Response:
        return error_response(request, unsupported("generate"))

    async def refuse_embed(request: Request) -> Response:
        return error_response(request, unsupported("embed"))

    if "generate" not in tasks:
        for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
            app.add_api_route(path, refuse_generate, methods=["POST"])
    if "embed" not in tasks:
        for path in POOLING_PATHS:
            app.add_api_route(path, refuse_embed, methods=["POST"])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    app.include_router(build_admin_router(engine, config.enable_admin_api))
    return app
