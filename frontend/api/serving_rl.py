"""RL-training routes (vLLM's shapes), served with --enable-rl-api or VLLM_SERVER_DEV_MODE=1.

    POST /pause?mode=abort|wait|keep&clear_cache=false   → {"status": "paused"}
    POST /resume                                          → {"status": "resumed"}
    GET  /is_paused                                       → {"is_paused": bool}
    POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
                                       rank_offset, world_size}}
    POST /update_weights {"update_info": {names, dtype_names, shapes, packed}}
                         (file backend: {"update_info": {"path", "names"?}})
    POST /start_weight_update, POST /finish_weight_update {"weight_version"}
    GET  /weight_info                                     → {"weight_version"}
    GET  /get_world_size?include_dp=true                  → {"world_size"}
    POST /weight_checker {"action": "checksum"}           → {"weight_version", "checksums"}
                         {"action": "compare", "baseline": {name: sha256}}
                                                          → {"match", "mismatched", "unknown"}
    POST /abort_requests {"request_ids": [...]}           → {"status": "aborted", "aborted": n}

The engine does the work (engine_core/core/training.py); these routes check
the bodies and wait where the call means to: `/pause?mode=wait` answers
once the admitted requests have finished. They are admin routes: with
--admin-api-key set they need that key (security.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from pagoda.frontend.api.errors import APIError, read_json
from pagoda.frontend.api.serving_admin import utility
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.dp_client import DPClient
from pagoda.protocol.control import timeout_of

RL_PATHS = frozenset(
    {
        "/pause",
        "/resume",
        "/is_paused",
        "/init_weight_transfer_engine",
        "/update_weights",
        "/start_weight_update",
        "/finish_weight_update",
        "/weight_info",
        "/get_world_size",
        "/weight_checker",
        "/abort_requests",
    }
)
_DRAIN_POLL_S = 0.05


def _flag(value: str, name: str) -> bool:
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise APIError(400, f"{name} must be true or false", name)


def _object_field(body: Any, field: str) -> dict[str, Any]:
    if not isinstance(body, dict) or not isinstance(body.get(field), dict):
        raise APIError(400, f"expected an object with an object `{field}`", field)
    return dict(body[field])


def build_router(engine: AsyncLLM) -> APIRouter:
    router = APIRouter()

    async def call(method: str, *args: Any) -> Any:
        client = engine.client
        return await utility(lambda: client.call_utility(method, *args, timeout=timeout_of(method)))

    @router.post("/pause")
    async def pause(mode: str = "abort", clear_cache: str = "false") -> dict[str, str]:
        if mode not in ("abort", "wait", "keep"):
            raise APIError(400, "mode must be abort, wait or keep", "mode")
        await call("pause", mode, _flag(clear_cache, "clear_cache"))
        if mode == "wait":  # answered once the admitted requests are done
            while (await call("pause_state"))["num_unfinished"]:
                await asyncio.sleep(_DRAIN_POLL_S)
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, str]:
        await call("resume")
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": bool(await call("is_paused"))}

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict[str, str]:
        init_info = _object_field(await read_json(request), "init_info")
        client = engine.client
        if isinstance(client, DPClient):
            # Data-parallel engines take consecutive blocks of ranks after the
            # offset, all joining at once (the group forms when all are in).
            size = int(await call("get_world_size"))
            offset = init_info.get("rank_offset", 1)
            if isinstance(offset, bool) or not isinstance(offset, int):
                raise APIError(400, "init_info.rank_offset must be an integer", "init_info")
            method = "init_weight_transfer_engine"
            await utility(
                lambda: asyncio.gather(
                    *(
                        c.call_utility(
                            method,
                            {**init_info, "rank_offset": offset + i * size},
                            timeout=timeout_of(method),
                        )
                        for i, c in enumerate(client.clients)
                    )
                )
            )
        else:
            await call("init_weight_transfer_engine", init_info)
        return {"message": "Weight transfer initialized"}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        update_info = _object_field(await read_json(request), "update_info")
        result = await call("update_weights", update_info)
        return {"message": "Weights updated", **result}

    @router.post("/start_weight_update")
    async def start_weight_update() -> dict[str, str]:
        await call("start_weight_update")
        return {"message": "Weight update started"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict[str, Any]:
        version = None
        if await request.body():
            body = await read_json(request)
            if not isinstance(body, dict):
                raise APIError(400, "expected an object", "weight_version")
            version = body.get("weight_version")
            if version is not None and (
                isinstance(version, bool) or not isinstance(version, int | str)
            ):
                raise APIError(400, "weight_version must be an integer or a string")
        result = await call("finish_weight_update", version)
        return {"message": "Weight update finished", **result}

    @router.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return dict(await call("weight_info"))

    @router.get("/get_world_size")
    async def get_world_size(include_dp: str = "true") -> dict[str, int]:
        size = int(await call("get_world_size"))
        client = engine.client
        if _flag(include_dp, "include_dp") and isinstance(client, DPClient):
            size *= len(client.clients)
        return {"world_size": size}

    @router.post("/weight_checker")
    async def weight_checker(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("action", "checksum"), str):
            raise APIError(400, "expected an object with a string `action`", "action")
        action = body.get("action", "checksum")
        if action not in ("checksum", "compare"):
            raise APIError(400, f"action must be 'checksum' or 'compare', got {action!r}", "action")
        baseline = body.get("baseline")
        if action == "compare" and (
            not isinstance(baseline, dict)
            or not baseline
            or not all(isinstance(v, str) for v in baseline.values())
        ):
            raise APIError(400, "compare needs a baseline: {tensor name: sha256}", "baseline")
        return dict(await call("weight_checker", action, baseline))

    @router.post("/abort_requests")
    async def abort_requests(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise APIError(400, "request_ids must be a list of strings", "request_ids")
        if len(ids) > 100_000:
            raise APIError(400, "too many request_ids", "request_ids")
        # A completion's id covers its prompts' requests ("<id>-0", "<id>-1" ...).
        wanted = set(ids)
        aborted = 0
        for active in engine.active_request_ids:
            if active in wanted or active.rpartition("-")[0] in wanted:
                await engine.abort(active)
                aborted += 1
        return {"status": "aborted", "aborted": aborted}

    return router
