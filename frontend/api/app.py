"""The FastAPI application of one API server, built on an AsyncLLM.

`build_app` creates the app, installs the middlewares and includes one
router per route family (each `serving_*.py` module has its `build_router`).
Which families it includes follows the tasks the engine's Ready lists:
the generation routes for "generate", the pooling routes for "embed", the
audio routes (`serving_audio.py`) for "transcription" (a Whisper model), the
realtime WebSocket (`serving_realtime.py`) for either of those two; the
routes of a task the model lacks answer 400 naming its tasks
(`serving_refusals.py`). With --tokens-only (no tokenizer) it includes the
token routes and those that need no tokenizer only. The web UI (`serving_ui.py`,
at /, unless --disable-web-ui) and the docs pages (`serving_docs.py`, /docs
and /redoc, served from here rather than a CDN) come with every app.

Middlewares, outermost first; each is plain ASGI and covers HTTP and
WebSocket scopes (see `middleware.py` for how a WebSocket handshake is
refused):

    RefuseWhileDraining   503 while the server drains (shutdown)
    RequestIdAndSize      X-Request-Id; a Content-Length over the limit is a 413
    CORSMiddleware        only with --allowed-origins
    KeyCheck              --api-key / --admin-api-key (`security.py`)
    BodyGuard             body size and lone surrogates, before any route parses
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pagoda.frontend.api.audio_form import audio_body_limit
from pagoda.frontend.api.body_guard import BodyGuard
from pagoda.frontend.api.errors import install_error_handlers
from pagoda.frontend.api.inflight import InFlight
from pagoda.frontend.api.mcp_tools import ToolServer
from pagoda.frontend.api.middleware import RefuseWhileDraining, RequestIdAndSize
from pagoda.frontend.api.security import install_auth
from pagoda.frontend.api.serving_admin import build_router as build_admin_router
from pagoda.frontend.api.serving_anthropic import build_router as build_anthropic_router
from pagoda.frontend.api.serving_audio import AudioServer
from pagoda.frontend.api.serving_audio import build_router as build_audio_router
from pagoda.frontend.api.serving_chat import ChatServer
from pagoda.frontend.api.serving_completion import CompletionServer
from pagoda.frontend.api.serving_docs import build_router as build_docs_router
from pagoda.frontend.api.serving_docs import docs_paths
from pagoda.frontend.api.serving_generation import build_router as build_generation_router
from pagoda.frontend.api.serving_lora import build_router as build_lora_router
from pagoda.frontend.api.serving_metrics import build_router as build_metrics_router
from pagoda.frontend.api.serving_models import VERSION
from pagoda.frontend.api.serving_models import build_router as build_models_router
from pagoda.frontend.api.serving_pooling import PoolingServer
from pagoda.frontend.api.serving_pooling import build_router as build_pooling_router
from pagoda.frontend.api.serving_realtime import build_router as build_realtime_router
from pagoda.frontend.api.serving_refusals import build_router as build_refusals_router
from pagoda.frontend.api.serving_responses import build_router as build_responses_router
from pagoda.frontend.api.serving_rl import build_router as build_rl_router
from pagoda.frontend.api.serving_sagemaker import build_router as build_sagemaker_router
from pagoda.frontend.api.serving_scoring import build_router as build_scoring_router
from pagoda.frontend.api.serving_tokenize import build_router as build_tokenize_router
from pagoda.frontend.api.serving_tokens import TokensServer
from pagoda.frontend.api.serving_tokens import build_router as build_tokens_router
from pagoda.frontend.api.serving_ui import asset_paths
from pagoda.frontend.api.serving_ui import build_router as build_ui_router
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.realtime import RealtimeLimits

# Paths that answer while the server drains: monitoring sees the shutdown through.
DRAIN_OPEN_PATHS = ("/metrics", "/load", "/version")


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
    # An audio upload (speech to text) over this is a 413; a Whisper server's body
    # limit grows to fit it.
    max_audio_file_bytes: int = 25 << 20
    # Set only with --enable-auto-tool-choice: tool_choice "auto" is refused without it.
    tool_call_parser: str | None = None
    enable_admin_api: bool = False  # POST /collective_rpc
    enable_rl_api: bool = False  # /pause, /update_weights ... (serving_rl.py)
    admin_api_key: str | None = None
    # Generation requests in flight in this API server beyond which new ones get 503.
    max_inflight_requests: int | None = None
    # /metrics is open (scrapers rarely carry keys) unless this is set.
    metrics_require_auth: bool = False
    # No tokenizer: the /inference/v1 token routes only (serving_tokens.py).
    tokens_only: bool = False
    # The chat page at / (serving_ui.py); off with --disable-web-ui and with tokens_only.
    enable_web_ui: bool = True
    # WS /v1/realtime (serving_realtime.py): sessions and what each may do.
    realtime_limits: RealtimeLimits = RealtimeLimits()
    # `pagoda serve --enable-elastic-ep`'s supervisor socket: /scale_elastic_ep
    # (serving_elastic.py) resizes the data-parallel engines through it.
    elastic_supervisor: str | None = None

    @property
    def serves_web_ui(self) -> bool:
        return self.enable_web_ui and not self.tokens_only


def build_app(
    engine: AsyncLLM, config: FrontendConfig, tool_servers: dict[str, ToolServer] | None = None
) -> FastAPI:
    """The API server's app; `tool_servers` are the resolved --tool-server MCP servers.

    `app.state.drain(timeout)` drains it (SIGTERM); `app.state.engine` is the AsyncLLM.
    """
    # FastAPI's own docs pages load their scripts from a CDN: serving_docs.py replaces them.
    app = FastAPI(title="Pagoda", version=VERSION, docs_url=None, redoc_url=None)
    in_flight = InFlight(engine, config.max_inflight_requests)
    app.state.engine = engine
    app.state.drain = in_flight.drain
    install_error_handlers(app)
    if "transcription" in engine.ready.supported_tasks:
        limit = audio_body_limit(config.max_request_body_bytes, config.max_audio_file_bytes)
        config = dataclasses.replace(config, max_request_body_bytes=limit)
    _install_middleware(app, config, in_flight)
    for router in _routers(engine, config, in_flight, tool_servers):
        app.include_router(router)
    if config.elastic_supervisor is not None:
        app.include_router(_elastic_router(engine, config.elastic_supervisor, in_flight))
    return app


def _elastic_router(engine: AsyncLLM, supervisor: str, in_flight: InFlight) -> APIRouter:
    from pagoda.frontend.api.serving_elastic import build_router as build_elastic_router
    from pagoda.frontend.dp_client import DPClient
    from pagoda.frontend.elastic import ElasticScaler, SupervisorLink

    assert isinstance(engine.client, DPClient)
    scaler = ElasticScaler(engine.client, SupervisorLink(supervisor))
    in_flight.refusal = lambda: (
        "the server is scaling its data parallel engines; retry shortly" if scaler.scaling else None
    )
    return build_elastic_router(scaler)


def _install_middleware(app: FastAPI, config: FrontendConfig, in_flight: InFlight) -> None:
    # Each add_middleware wraps the ones before it: the first added runs innermost.
    app.add_middleware(BodyGuard, max_bytes=config.max_request_body_bytes)
    static_paths = docs_paths() | (asset_paths() if config.serves_web_ui else frozenset())
    install_auth(
        app, config.api_keys, config.admin_api_key, config.metrics_require_auth, static_paths
    )
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=False,
        )
    app.add_middleware(RequestIdAndSize, max_bytes=config.max_request_body_bytes)
    app.add_middleware(
        RefuseWhileDraining, draining=lambda: in_flight.draining, open_paths=DRAIN_OPEN_PATHS
    )


def _routers(
    engine: AsyncLLM,
    config: FrontendConfig,
    in_flight: InFlight,
    tool_servers: dict[str, ToolServer] | None,
) -> list[APIRouter]:
    """The route families this engine's tasks call for, in the order they match."""
    served = [config.served_model_name or engine.model_name]
    tasks = list(engine.ready.supported_tasks)
    tokens = build_tokens_router(TokensServer(engine, served, config.tokens_only), in_flight)
    if config.tokens_only:
        # The routes that need no tokenizer.
        return [
            build_models_router(engine, served),
            build_metrics_router(in_flight, engine.metrics),
            build_admin_router(engine, config.enable_admin_api),
            *([build_rl_router(engine)] if config.enable_rl_api else []),
            *([build_lora_router(engine, served)] if engine.ready.enable_lora else []),
            tokens,
            build_docs_router(),
        ]
    chat = ChatServer(engine, served, config.tool_call_parser)
    completions = CompletionServer(engine, served)
    pooling = PoolingServer(engine, served) if "embed" in tasks else None
    routers = [
        build_models_router(engine, served),
        build_tokenize_router(engine, served, chat, completions),
        build_sagemaker_router(served[0], tasks, chat, completions, pooling, in_flight),
        build_metrics_router(in_flight, engine.metrics),
        build_admin_router(engine, config.enable_admin_api),
        *([build_rl_router(engine)] if config.enable_rl_api else []),
        build_refusals_router(served[0], tasks),
        build_docs_router(),
        *([build_ui_router(tasks)] if config.serves_web_ui else []),
    ]
    if engine.ready.enable_lora:
        routers.append(build_lora_router(engine, served))
    if "generate" in tasks:
        routers.append(build_generation_router(chat, completions, in_flight))
        routers.append(tokens)
        routers.append(build_anthropic_router(engine, served, chat, in_flight.counted))
        routers.append(build_scoring_router(engine, served, in_flight.counted))
        routers.append(
            build_responses_router(engine, served, chat, in_flight.counted, tool_servers)
        )
    if pooling is not None:
        routers.append(build_pooling_router(pooling, in_flight.counted))
    if "transcription" in tasks:
        audio_limit = config.max_audio_file_bytes
        routers.append(build_audio_router(engine, served, audio_limit, in_flight.counted))
    if "transcription" in tasks or "generate" in tasks:
        audio = (
            AudioServer(engine, served, config.max_audio_file_bytes)
            if "transcription" in tasks
            else None
        )
        routers.append(build_realtime_router(engine, served, config.realtime_limits, audio))
    return routers
