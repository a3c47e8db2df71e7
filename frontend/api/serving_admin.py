"""Engine-control routes: stats, prefix-cache reset, sleep / wake-up, profiling, RPC.

    GET  /stats                  the engine's latest stats
    POST /reset_prefix_cache     (alias /reset-prefix-cache)
    POST /sleep?level=1|2
    POST /wake_up?tags=...       (alias /wake-up)
    GET  /is_sleeping
    POST /start_profile          (alias /start-profile)
    POST /stop_profile           (alias /stop-profile)  → {"trace": path}
    POST /collective_rpc         only with --enable-admin-api; an allowlist of methods

Each is a utility call to the engine core. A refused or failed call answers
in the API's error shape: 400 (unknown method, invalid), 404, 409 (busy),
500 (failed), 503 when the engine is gone, 504 when it does not answer in
time. The hyphenated aliases are left out of the OpenAPI schema. Which key
these routes need is decided in `security.py`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from pagoda.frontend.api.common import unavailable
from pagoda.frontend.api.errors import APIError, read_json
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.dp_client import DPClient
from pagoda.frontend.engine_client import EngineDeadError, UtilityError
from pagoda.protocol.control import ADMIN_RPC_CALLS, CONTROL_CALLS

# What POST /collective_rpc may call on the engine: the calls of
# protocol/control.py marked admin_rpc; anything else is a 400.
ADMIN_RPC_METHODS = ADMIN_RPC_CALLS
MAX_RPC_TIMEOUT_S = 600.0
# HTTP status of a failed engine utility call, by UtilityError.kind.
_UTILITY_STATUS = {
    "unknown_method": 400,
    "invalid": 400,
    "not_found": 404,
    "busy": 409,
    "failed": 500,
}


async def utility(call: Callable[[], Awaitable[Any]]) -> Any:
    """Run one engine utility call; its failures become APIErrors that say why."""
    try:
        return await call()
    except UtilityError as e:  # the engine refused or failed: say why
        raise APIError(_UTILITY_STATUS.get(e.kind, 500), str(e)[:300]) from None
    except EngineDeadError as e:
        raise unavailable(f"the engine core is not available: {e}") from None
    except TimeoutError:
        raise APIError(504, "the engine core did not answer in time") from None


def _rpc_call(body: Any) -> tuple[str, list[Any], dict[str, Any], float]:
    """Check a /collective_rpc body: (method, args, kwargs, timeout) or a 400."""
    if not isinstance(body, dict) or not isinstance(body.get("method"), str):
        raise APIError(400, "expected an object with a string `method`", "method")
    method = body["method"]
    if method not in ADMIN_RPC_METHODS:
        allowed = ", ".join(sorted(ADMIN_RPC_METHODS))
        raise APIError(400, f"method {method!r} is not allowed; one of {allowed}", "method")
    args = body.get("args") or []
    kwargs = body.get("kwargs") or {}
    if not isinstance(args, list):
        raise APIError(400, "args must be a list", "args")
    if not isinstance(kwargs, dict):
        raise APIError(400, "kwargs must be an object", "kwargs")
    timeout = body.get("timeout")
    if timeout is None:
        timeout = 30.0
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= MAX_RPC_TIMEOUT_S
    ):
        raise APIError(400, f"timeout must be in (0, {MAX_RPC_TIMEOUT_S:g}]", "timeout")
    return method, args, kwargs, float(timeout)


def build_router(engine: AsyncLLM, enable_admin_api: bool) -> APIRouter:
    """The engine-control routes; /collective_rpc only when `enable_admin_api`."""
    router = APIRouter()

    @router.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(await engine.get_stats())

    @router.post("/reset_prefix_cache")
    @router.post("/reset-prefix-cache", include_in_schema=False)  # alias
    async def reset_prefix_cache() -> Response:
        await utility(engine.reset_prefix_cache)
        return Response(status_code=200)

    @router.post("/sleep")
    async def sleep(level: str = "1") -> Response:
        """Level 1 frees the KV cache and parks the weights; 2 drops the weights too."""
        if level not in ("1", "2"):
            raise APIError(400, "level must be 1 or 2", "level")
        await utility(lambda: engine.sleep(int(level)))
        return Response(status_code=200)

    @router.post("/wake_up")
    @router.post("/wake-up", include_in_schema=False)  # alias of /wake_up
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        await utility(lambda: engine.wake_up(tags))
        return Response(status_code=200)

    if enable_admin_api:

        @router.post("/collective_rpc")
        async def collective_rpc(request: Request) -> dict[str, Any]:
            """{method, args, kwargs, timeout} → {"results": [one per engine core]}."""
            method, args, kwargs, timeout = _rpc_call(await read_json(request))
            client = engine.client
            if isinstance(client, DPClient):  # one result per engine core
                results = await utility(
                    lambda: client.call_utility_all(method, *args, timeout=timeout, kwargs=kwargs)
                )
            else:
                results = [
                    await utility(
                        lambda: client.call_utility(method, *args, timeout=timeout, kwargs=kwargs)
                    )
                ]
            if CONTROL_CALLS[method].sleep_state:
                # Keep this server's view of the engine in step without waiting for stats.
                await utility(engine.is_sleeping)  # also records the answer
            return {"results": results}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await utility(engine.is_sleeping)}

    @router.post("/start_profile")
    @router.post("/start-profile", include_in_schema=False)  # alias
    async def start_profile() -> Response:
        await utility(engine.start_profile)
        return Response(status_code=200)

    @router.post("/stop_profile")
    @router.post("/stop-profile", include_in_schema=False)  # alias
    async def stop_profile() -> dict[str, str]:
        return {"trace": await utility(engine.stop_profile)}

    return router
