"""`api-server`: an HTTP server attached to a running engine core."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import setproctitle
import uvicorn

from pagoda.frontend.api.tool_calls import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from pagoda.frontend.api.mcp_tools import ToolServer


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("api server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="required bearer key (repeatable; also PAGODA_API_KEY)",
    )
    g.add_argument("--chat-template", default=None, help="a jinja template file or string")
    g.add_argument(
        "--allowed-origins",
        type=_str_list,
        default=[],
        help="CORS origins, a JSON list or comma-separated (default: CORS closed)",
    )
    g.add_argument("--allowed-methods", type=_str_list, default=["*"])
    g.add_argument("--allowed-headers", type=_str_list, default=["*"])
    g.add_argument(
        "--max-request-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413"
    )
    g.add_argument(
        "--max-audio-file-bytes",
        type=int,
        default=25 << 20,
        help="larger audio uploads get 413 (speech to text; the body limit grows to fit)",
    )
    g.add_argument(
        "--realtime-max-sessions",
        type=_positive(int),
        default=100,
        help="per API server: WebSocket sessions (/v1/realtime) beyond this many are closed 1008",
    )
    g.add_argument(
        "--realtime-max-audio-bytes",
        type=_positive(int),
        default=25 << 20,
        help="PCM16 audio one realtime utterance may buffer (default 25 MiB, about 13 min)",
    )
    g.add_argument(
        "--realtime-idle-timeout",
        type=_positive(float),
        default=300.0,
        metavar="SECONDS",
        help="a realtime session that sends nothing this long while nothing of it runs is closed",
    )
    g.add_argument(
        "--realtime-max-messages-per-second",
        type=_positive(float),
        default=100.0,
        help="client events per second one realtime session may send (a burst of one second)",
    )
    g.add_argument("--uvicorn-log-level", default="warning")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    g.add_argument(
        "--metrics-require-auth",
        action="store_true",
        help="GET /metrics needs the --api-key too (open by default)",
    )
    g.add_argument(
        "--tool-server",
        action="append",
        default=[],
        help="an MCP server for /v1/responses: [label=]http(s)://host:port/path or "
        "[label=]stdio:COMMAND ARGS (repeatable, or comma-separated)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how tool calls are found in the model's text",
    )
    g.add_argument(
        "--enable-admin-api",
        action="store_true",
        help="serve POST /collective_rpc (allow-listed engine utility calls)",
    )
    g.add_argument(
        "--enable-rl-api",
        action="store_true",
        help="serve the RL-training routes: /pause, /resume, /update_weights ... "
        "(also when VLLM_SERVER_DEV_MODE=1)",
    )
    g.add_argument(
        "--elastic-ep-supervisor",
        default=None,
        metavar="ADDR",
        help="set by `pagoda serve --enable-elastic-ep`: its supervisor socket "
        "(POST /scale_elastic_ep)",
    )
    g.add_argument(
        "--admin-api-key",
        default=None,
        help="key for /collective_rpc, /sleep, /wake_up, profiling, cache reset (not --api-key)",
    )
    g.add_argument(
        "--tokens-only",
        action="store_true",
        help="load no tokenizer and serve token ids only: POST /inference/v1/generate and "
        "/inference/v1/abort_requests (with health, models, metrics, control routes)",
    )
    g.add_argument(
        "--disable-web-ui",
        action="store_true",
        help="serve no chat page at / (the API and the /docs pages stay)",
    )
    g.add_argument(
        "--max-inflight-requests",
        type=int,
        default=None,
        help="per API server: generation requests beyond this many get 503 + Retry-After",
    )
    g.add_argument(
        "--http-header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a connection whose request headers are not complete this long gets 408 and is closed",
    )
    g.add_argument(
        "--http-body-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a request whose body is not complete this long after its headers gets 408 and its "
        "connection is closed",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM, let in-flight requests finish this long, then abort them",
    )


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` above zero."""

    def parse(value: str) -> float:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
        if not number > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
        return number

    return parse


def _str_list(value: str) -> list[str]:
    """vLLM passes these as JSON lists; a comma-separated string works too."""
    value = value.strip()
    if value.startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return parsed
    return [v.strip() for v in value.split(",") if v.strip()]


def frontend_args_to_argv(ns: argparse.Namespace) -> list[str]:
    argv = ["--host", ns.host, "--port", str(ns.port), "--uvicorn-log-level", ns.uvicorn_log_level]
    argv += [
        "--allowed-origins",
        json.dumps(ns.allowed_origins),
        "--allowed-methods",
        json.dumps(ns.allowed_methods),
        "--allowed-headers",
        json.dumps(ns.allowed_headers),
        "--max-request-body-bytes",
        str(ns.max_request_body_bytes),
        "--max-audio-file-bytes",
        str(ns.max_audio_file_bytes),
        "--realtime-max-sessions",
        str(ns.realtime_max_sessions),
        "--realtime-max-audio-bytes",
        str(ns.realtime_max_audio_bytes),
        "--realtime-idle-timeout",
        str(ns.realtime_idle_timeout),
        "--realtime-max-messages-per-second",
        str(ns.realtime_max_messages_per_second),
    ]
    for key in ns.api_key or []:
        argv += ["--api-key", key]
    if ns.chat_template:
        argv += ["--chat-template", ns.chat_template]
    if ns.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    if ns.tool_call_parser:
        argv += ["--tool-call-parser", ns.tool_call_parser]
    for spec in ns.tool_server:
        argv += ["--tool-server", spec]
    if ns.metrics_require_auth:
        argv.append("--metrics-require-auth")
    if ns.enable_admin_api:
        argv.append("--enable-admin-api")
    if ns.enable_rl_api:
        argv.append("--enable-rl-api")
    if ns.admin_api_key:
        argv += ["--admin-api-key", ns.admin_api_key]
    if ns.tokens_only:
        argv.append("--tokens-only")
    if ns.disable_web_ui:
        argv.append("--disable-web-ui")
    if ns.max_inflight_requests is not None:
        argv += ["--max-inflight-requests", str(ns.max_inflight_requests)]
    argv += ["--http-header-timeout", str(ns.http_header_timeout)]
    argv += ["--http-body-timeout", str(ns.http_body_timeout)]
    argv += ["--shutdown-timeout", str(ns.shutdown_timeout)]
    return argv


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket that several API server processes can share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT handled on our loop so that the exit code is 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def request_exit(self) -> None:
        self.should_exit = True


async def serve(ns: argparse.Namespace) -> int:
    from pagoda.frontend.api.app import FrontendConfig, build_app
    from pagoda.frontend.async_llm import AsyncLLM
    from pagoda.frontend.engine_client import EngineDeadError
    from pagoda.frontend.http_protocol import header_timeout_protocol
    from pagoda.frontend.realtime import RealtimeLimits
    from pagoda.protocol.envs import api_key_from_env

    log = logging.getLogger("api-server")
    keys = list(ns.api_key or [])
    env_key = api_key_from_env()
    if not keys and env_key:
        keys = [env_key]
    config = FrontendConfig(
        host=ns.host,
        port=ns.port,
        api_keys=tuple(keys),
        served_model_name=ns.served_model_name,
        chat_template=ns.chat_template,
        allowed_origins=tuple(ns.allowed_origins),
        allowed_methods=tuple(ns.allowed_methods),
        allowed_headers=tuple(ns.allowed_headers),
        max_request_body_bytes=ns.max_request_body_bytes,
        max_audio_file_bytes=ns.max_audio_file_bytes,
        tool_call_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
        metrics_require_auth=ns.metrics_require_auth,
        enable_admin_api=ns.enable_admin_api,
        enable_rl_api=ns.enable_rl_api or os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        admin_api_key=ns.admin_api_key,
        max_inflight_requests=ns.max_inflight_requests,
        tokens_only=ns.tokens_only,
        enable_web_ui=not ns.disable_web_ui,
        realtime_limits=RealtimeLimits(
            max_sessions=ns.realtime_max_sessions,
            max_audio_bytes=ns.realtime_max_audio_bytes,
            idle_timeout=ns.realtime_idle_timeout,
            max_messages_per_second=ns.realtime_max_messages_per_second,
        ),
        elastic_supervisor=ns.elastic_ep_supervisor,
    )
    if ns.enable_admin_api and not ns.admin_api_key:
        log.warning("--enable-admin-api without --admin-api-key: /collective_rpc is open")
    sock = bind_socket(ns.host, ns.port)
    try:
        engine = await AsyncLLM.connect(
            ns.engine,
            chat_template=ns.chat_template,
            timeout=ns.engine_timeout,
            curve_dir=ns.curve_keys,
            log_stats=True,
            served_model_name=ns.served_model_name,
            skip_tokenizer_init=ns.tokens_only,
            elastic=ns.elastic_ep_supervisor is not None,
        )
    except EngineDeadError as e:
        log.error("%s", e)
        return 3
    try:
        tool_servers = await _tool_servers(ns.tool_server)
    except ValueError as e:
        log.error("%s", e)
        await engine.client.close()
        return 2
    app = build_app(engine, config, tool_servers)
    server = _Server(
        uvicorn.Config(
            app,
            log_level=ns.uvicorn_log_level,
            loop="none",
            timeout_graceful_shutdown=5,
            http=header_timeout_protocol(ns.http_header_timeout, ns.http_body_timeout),
        )
    )
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task[None]] = []

    async def drain_then_exit() -> None:
        try:
            aborted = await app.state.drain(ns.shutdown_timeout)
            if aborted:
                log.warning("shutdown: aborted %d requests still running", aborted)
        finally:
            server.request_exit()

    def on_signal() -> None:
        # First signal: drain gracefully; a second one: exit now.
        if draining:
            server.request_exit()
            return
        log.info("stopping: draining for up to %.1f s", ns.shutdown_timeout)
        draining.append(loop.create_task(drain_then_exit()))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    print(f"api-server on http://{ns.host}:{ns.port} serving {engine.model_name}", flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        await engine.client.close()
    return 0


async def _tool_servers(specs: list[str]) -> dict[str, ToolServer]:
    """--tool-server values, parsed and reached once (ValueError says which failed)."""
    from pagoda.frontend.api.mcp_tools import parse_tool_server, resolve

    parsed = [parse_tool_server(s) for spec in specs for s in _split_specs(spec)]
    return await resolve(parsed) if parsed else {}


def _split_specs(spec: str) -> list[str]:
    # vLLM takes a comma-separated list; a stdio command line may hold no comma.
    return [s.strip() for s in spec.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="api-server", description=__doc__)
    parser.add_argument(
        "--engine",
        required=True,
        help="the engine core's address; several, comma-separated, for data-parallel engine cores",
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the engine core to answer",
    )
    parser.add_argument(
        "--curve-keys",
        default=None,
        metavar="DIR",
        help="the CURVE keys of a tcp engine core started with --curve-keys",
    )
    parser.add_argument(
        "--api-server-index",
        type=int,
        default=0,
        help="this API server's index among those of one deployment (shown in its process title)",
    )
    add_frontend_args(parser)
    ns = parser.parse_args(argv)
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    # What ps and top show: the role first, then the flags it was started with.
    flags = sys.argv[1:] if argv is None else argv
    setproctitle.setproctitle(" ".join([f"pagoda::api-server-{ns.api_server_index}", *flags]))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvloop

    return uvloop.run(serve(ns))


if __name__ == "__main__":
    sys.exit(main())
