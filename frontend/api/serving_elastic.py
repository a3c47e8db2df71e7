"""Elastic EP routes (vLLM's names and shapes), with `pagoda serve --enable-elastic-ep`:

    POST /scale_elastic_ep        {"new_data_parallel_size": N, "drain_timeout": 120}
                                  → {"message": "Scaled to N data parallel engines",
                                     "new_data_parallel_size": N}
    GET|POST /is_scaling_elastic_ep → {"is_scaling_elastic_ep": bool}

Errors in the API's shape: a size missing, not an integer (a bool is not
one) or below 1, or a drain_timeout that is not a positive number: 400; the
size already served: 400; a scale already running: 409; requests that did
not drain in time: 408 (the old size serves on); engines that did not start
or a supervisor that failed: 500 (the old size serves on). The scale route
needs the admin key when one is set (security.py). How a scale runs:
frontend/elastic.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagoda.frontend.api.errors import APIError, read_json
from pagoda.frontend.elastic import ElasticScaler, ScaleError

DEFAULT_DRAIN_TIMEOUT_S = 120.0


def _scale_body(body: Any) -> tuple[int, float]:
    if not isinstance(body, dict):
        raise APIError(400, "expected a JSON object", "new_data_parallel_size")
    size = body.get("new_data_parallel_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise APIError(
            400, "new_data_parallel_size must be a positive integer", "new_data_parallel_size"
        )
    drain = body.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT_S)
    if isinstance(drain, bool) or not isinstance(drain, int | float) or not drain > 0:
        raise APIError(400, "drain_timeout must be a positive number of seconds", "drain_timeout")
    return size, float(drain)


def build_router(scaler: ElasticScaler) -> APIRouter:
    router = APIRouter()

    @router.post("/scale_elastic_ep")
    async def scale_elastic_ep(request: Request) -> JSONResponse:
        size, drain = _scale_body(await read_json(request))
        try:
            await scaler.scale(size, drain)
        except ScaleError as e:
            raise APIError(e.status, str(e)) from None
        return JSONResponse(
            {"message": f"Scaled to {size} data parallel engines", "new_data_parallel_size": size}
        )

    @router.get("/is_scaling_elastic_ep")
    @router.post("/is_scaling_elastic_ep")
    async def is_scaling_elastic_ep() -> dict[str, bool]:
        return {"is_scaling_elastic_ep": scaler.scaling}

    return router
