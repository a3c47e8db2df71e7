"""`pagoda proxy`: disaggregated prefill and decode behind one OpenAI endpoint.

Each `/v1/completions` or `/v1/chat/completions` request goes first to the
least-loaded healthy prefill instance with `max_tokens` 1, no streaming and
`kv_transfer_params: {"do_remote_decode": true}`; the instance keeps the
prompt's KV and answers the parameters a decode engine needs to pull it.
Then the original request, with those parameters, goes to the least-loaded
healthy decode instance, whose answer (streamed or not) goes back to the
client as it comes. Both kinds of instance are `pagoda serve` (or
`api-server` + `engine-core`) with `--kv-transfer-config` naming the
PeerConnector as producer and consumer (docs/running.md).

Load is the number of requests this proxy has in flight on an instance. An
instance that refuses a connection or answers 5xx is marked down and the next
one is tried (a prefill); a background task checks `/health` every few
seconds and brings instances back. No healthy instance of a kind: 503 in
OpenAI's error shape. A client that goes away cancels the call in progress,
and the instance aborts its request. `GET /healthcheck` says how many
instances of each kind are up; `/metrics` counts requests, KV transferred
or recomputed (from the decode engines' answers), and prefill time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger("pagoda.proxy")

HEALTH_INTERVAL_S = 2.0
# Headers passed on to the instances (the API key among them).
FORWARDED_HEADERS = ("authorization", "x-request-id", "content-type")


@dataclass
class Instance:
    url: str
    kind: str  # "prefill" | "decode"
    healthy: bool = True
    in_flight: int = 0


class NoInstance(Exception):
    """No healthy instance of a kind can take the request."""


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class Proxy:
    """The instances, their load and health, and the two-step request."""

    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float) -> None:
        self.instances = [Instance(u.rstrip("/"), "prefill") for u in prefill] + [
            Instance(u.rstrip("/"), "decode") for u in decode
        ]
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagoda_proxy:requests",
            "Requests by outcome (ok, client_error, unavailable, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.kv = Counter(
            "pagoda_proxy:kv",
            "Decode answers by how their KV came: transferred or recomputed.",
            ["how"],
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "pagoda_proxy:prefill_seconds",
            "Time of the prefill step.",
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.up = Gauge(
            "pagoda_proxy:instance_up", "1 if healthy.", ["kind", "url"], registry=self.registry
        )
        for inst in self.instances:
            self.up.labels(inst.kind, inst.url).set(1)

    def of(self, kind: str) -> list[Instance]:
        return [i for i in self.instances if i.kind == kind]

    def candidates(self, kind: str) -> list[Instance]:
        """Healthy instances of a kind, least loaded first."""
        healthy = [i for i in self.of(kind) if i.healthy]
        if not healthy:
            raise NoInstance(f"no healthy {kind} instance")
        return sorted(healthy, key=lambda i: i.in_flight)

    def mark(self, inst: Instance, healthy: bool) -> None:
        if inst.healthy != healthy:
            logger.warning("%s instance %s is %s", inst.kind, inst.url, "up" if healthy else "down")
        inst.healthy = healthy
        self.up.labels(inst.kind, inst.url).set(1 if healthy else 0)

    async def check_health(self) -> None:
        async def check(inst: Instance) -> None:
            try:
                r = await self.client.get(f"{inst.url}/health", timeout=2.0)
                self.mark(inst, r.status_code == 200)
            except httpx.HTTPError:
                self.mark(inst, False)

        await asyncio.gather(*(check(i) for i in self.instances))

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            await self.check_health()

    # ----------------------------------------------------------- requests

    async def prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | Response:
        """Run the prompt on a prefill instance; the kv_transfer_params it answers
        (or the instance's own client error, passed on as is)."""
        step = dict(body, stream=False, kv_transfer_params={"do_remote_decode": True})
        step.pop("stream_options", None)
        step["min_tokens"] = 0
        if path.endswith("chat/completions"):
            step.pop("max_tokens", None)
            step["max_completion_tokens"] = 1
        else:
            step["max_tokens"] = 1
        started = time.monotonic()
        for inst in self.candidates("prefill"):
            inst.in_flight += 1
            try:
                r = await self.client.post(f"{inst.url}{path}", json=step, headers=headers)
            except httpx.HTTPError as e:
                logger.warning("prefill at %s failed: %s", inst.url, e)
                self.mark(inst, False)
                continue
            finally:
                inst.in_flight -= 1
            if r.status_code >= 500:
                self.mark(inst, False)
                continue
            if r.status_code != 200:  # the client's mistake: the same on every instance
                return Response(r.content, r.status_code, media_type="application/json")
            self.prefill_seconds.observe(time.monotonic() - started)
            params = r.json().get("kv_transfer_params")
            return params if isinstance(params, dict) else {}
        raise NoInstance("no prefill instance could take the request")

    async def handle(self, path: str, raw: Request) -> Response:
        try:
            body = await raw.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        headers = {k: v for k, v in raw.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            self.candidates("decode")  # no prefill work for a request no decoder can take
            prefill = asyncio.ensure_future(self.prefill(path, body, headers))
            params = await _unless_disconnected(raw, prefill)
            if params is None:
                self.requests.labels("failed").inc()
                return Response(status_code=499)
            if isinstance(params, Response):
                self.requests.labels("client_error").inc()
                return params
            return await self.decode(path, dict(body, kv_transfer_params=params), headers)
        except NoInstance as e:
            self.requests.labels("unavailable").inc()
            return _error(503, str(e))

    async def decode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        for inst in self.candidates("decode"):
            inst.in_flight += 1
            url = f"{inst.url}{path}"
            try:
                r = await self.client.send(
                    self.client.build_request("POST", url, json=body, headers=headers), stream=True
                )
            except httpx.HTTPError as e:
                inst.in_flight -= 1
                logger.warning("decode at %s failed: %s", inst.url, e)
                self.mark(inst, False)
                continue
            return await self._answer(inst, r)
        raise NoInstance("no decode instance could take the request")

    async def _answer(self, inst: Instance, r: httpx.Response) -> Response:
        """Pass a decode instance's answer on (streamed as it comes)."""
        if r.status_code >= 500:
            self.mark(inst, False)
        outcome = "ok" if r.status_code == 200 else "client_error"
        self.requests.labels(outcome if r.status_code < 500 else "failed").inc()
        media = r.headers.get("content-type", "application/json")
        if not media.startswith("text/event-stream"):
            try:
                content = await r.aread()
            finally:
                await r.aclose()
                inst.in_flight -= 1
            with contextlib.suppress(ValueError, AttributeError):
                self._count_kv(json.loads(content).get("kv_transfer_params"))
            return Response(content, r.status_code, media_type=media)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for line in r.aiter_lines():
                    if '"kv_transfer_params"' in line and line.startswith("data: "):
                        with contextlib.suppress(ValueError, AttributeError):
                            self._count_kv(json.loads(line[6:]).get("kv_transfer_params"))
                    yield (line + "\n").encode()
            except httpx.HTTPError as e:
                # The decode instance went away mid-answer: the client is told so.
                logger.warning("decode at %s failed mid-stream: %s", inst.url, e)
                self.mark(inst, False)
                error = {"error": {"message": f"the decode instance failed: {e}", "code": 502}}
                yield f"data: {json.dumps(error)}\n\n".encode()
            finally:
                await r.aclose()
                inst.in_flight -= 1

        return StreamingResponse(relay(), status_code=r.status_code, media_type=media)

    def _count_kv(self, params: Any) -> None:
        if isinstance(params, dict) and params.get("kv_transfer") in ("transferred", "recomputed"):
            self.kv.labels(params["kv_transfer"]).inc()


async def _unless_disconnected(raw: Request, task: asyncio.Future[Any]) -> Any:
    """The task's result, or None (the task cancelled) when the client goes away first."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            return None


def build_app(proxy: Proxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.check_health()
        checker = asyncio.create_task(proxy.health_loop())
        yield
        checker.cancel()
        await proxy.client.aclose()

    app = FastAPI(title="pagoda proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            inst = proxy.candidates("decode")[0]
            r = await proxy.client.get(f"{inst.url}/v1/models", headers=headers)
        except (NoInstance, httpx.HTTPError) as e:
            return _error(503, str(e))
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/healthcheck")
    async def healthcheck() -> JSONResponse:
        prefill = sum(i.healthy for i in proxy.of("prefill"))
        decode = sum(i.healthy for i in proxy.of("decode"))
        status = "ok" if prefill and decode else "unavailable"
        body = {"status": status, "prefill_instances": prefill, "decode_instances": decode}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/health")
    async def health() -> Response:
        ok = any(i.healthy for i in proxy.of("prefill")) and any(
            i.healthy for i in proxy.of("decode")
        )
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.registry), media_type="text/plain; version=0.0.4")

    return app


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill", nargs="+", action="extend", required=True, metavar="URL",
        help="prefill instances (KV producers), e.g. http://host:8100",
    )  # fmt: skip
    parser.add_argument(
        "--decode", nargs="+", action="extend", required=True, metavar="URL",
        help="decode instances (KV consumers)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds an instance may take to answer"
    )


def run_proxy(ns: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    proxy = Proxy(ns.prefill, ns.decode, ns.timeout)
    uvicorn.run(build_app(proxy), host=ns.host, port=ns.port, log_level="warning")
    return 0
