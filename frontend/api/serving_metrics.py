"""Load and metrics routes: GET /load (generation requests in flight here, vLLM's
server load) and GET /metrics (Prometheus text, when the AsyncLLM keeps metrics).

Both stay open while the server drains; /metrics is open to scrapers
without a key unless --metrics-require-auth (see `security.py`).
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from pagoda.frontend.api.inflight import InFlight
from pagoda.frontend.metrics import FrontendMetrics


def build_router(in_flight: InFlight, metrics: FrontendMetrics | None) -> APIRouter:
    router = APIRouter()

    @router.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": in_flight.count}

    if metrics is not None:

        @router.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return router
