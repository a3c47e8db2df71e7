"""LoRA adapter routes: vLLM's load/unload endpoints and the REST forms.

    POST   /v1/load_lora_adapter    {"lora_name", "lora_path"}   (vLLM)
    POST   /v1/unload_lora_adapter  {"lora_name"}                (vLLM)
    GET    /v1/loras                 the registered adapters
    POST   /v1/loras                 {"lora_name", "lora_path", "pinned"?}
    DELETE /v1/loras/{lora_name}
    POST   /v1/loras/{lora_name}/pin

Served only when the engine runs with --enable-lora. vLLM also requires
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for runtime loading; Pagoda accepts it
whenever LoRA is enabled. Errors: a path with no adapter 404, an unknown
adapter 404, a rank over --max-lora-rank 400, a name already loaded 400, an
adapter in use by requests 409.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from pagoda.frontend.api.common import now, unavailable
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.engine_client import EngineDeadError, UtilityError
from pagoda.protocol.messages import LoRARequest

# HTTP status of a refused LoRA call, by UtilityError.kind.
_STATUS = {"not_found": 404, "invalid": 400, "busy": 409, "unknown_method": 400}


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _field(body: dict[str, Any], *names: str) -> str:
    for name in names:
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise APIError(400, f"{name} must be a non-empty string", name)
            return value
    raise APIError(400, f"{names[0]} is required", names[0])


def lora_card(info: dict[str, Any], parent: str) -> dict[str, Any]:
    """An adapter as /v1/models and /v1/loras show it (root = its path, parent = base)."""
    return {
        "id": info["lora_name"],
        "object": "model",
        "created": now(),
        "owned_by": "pagoda",
        "root": info["lora_path"],
        "parent": parent,
        "lora_int_id": info["lora_int_id"],
        "rank": info["rank"],
        "pinned": info["pinned"],
    }


def build_router(engine: AsyncLLM, served: list[str]) -> APIRouter:
    router = APIRouter()

    async def call(work: Any) -> Any:
        try:
            return await work
        except UtilityError as e:
            raise APIError(_STATUS.get(e.kind, 500), str(e)[:500]) from None
        except EngineDeadError as e:
            raise unavailable(f"the engine core is not available: {e}") from None
        except TimeoutError:
            raise APIError(504, "the engine core did not answer in time") from None

    async def find(name: str) -> dict[str, Any]:
        for info in await call(engine.list_loras()):
            if info["lora_name"] == name:
                return dict(info)
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await _body(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        await call(engine.add_lora(LoRARequest(name, 0, path)))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        name = _field(await _body(request), "lora_name")
        await call(engine.remove_lora(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @router.get("/v1/loras")
    async def list_loras() -> dict[str, Any]:
        infos = await call(engine.list_loras())
        return {"object": "list", "data": [lora_card(i, served[0]) for i in infos]}

    @router.post("/v1/loras")
    async def create_lora(request: Request) -> dict[str, Any]:
        body = await _body(request)
        name, path = _field(body, "lora_name", "name"), _field(body, "lora_path", "path")
        pinned = body.get("pinned", False)
        if not isinstance(pinned, bool):
            raise APIError(400, "pinned must be a boolean", "pinned")
        await call(engine.add_lora(LoRARequest(name, 0, path)))
        if pinned:
            await call(engine.pin_lora(name))
        return lora_card(await find(name), served[0])

    @router.delete("/v1/loras/{lora_name}")
    async def delete_lora(lora_name: str) -> dict[str, Any]:
        await call(engine.remove_lora(lora_name))
        return {"id": lora_name, "object": "model", "deleted": True}

    @router.post("/v1/loras/{lora_name}/pin")
    async def pin_lora(lora_name: str) -> dict[str, Any]:
        await call(engine.pin_lora(lora_name))
        return lora_card(await find(lora_name), served[0])

    return router
