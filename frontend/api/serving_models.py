"""Health and model routes: /health, /ping (GET and POST: SageMaker probes
both), /version, and OpenAI's model list and retrieve, /v1/models and
/v1/models/{model} (the base model under each served name, and the LoRA
adapters the engine holds)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from pagoda.frontend.api.common import now
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.serving_lora import lora_card
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.engine_client import EngineDeadError, UtilityError

VERSION = "0.1.0"


def build_router(engine: AsyncLLM, served: list[str]) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if await engine.check_health():
            return Response(status_code=200)
        return APIError(503, "the engine core is not available").response()

    @router.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    async def cards() -> list[dict[str, Any]]:
        base = [
            {
                "id": name,
                "object": "model",
                "created": now(),
                "owned_by": "pagoda",
                "root": engine.ready.model_path,
                "parent": None,
                "max_model_len": engine.ready.max_model_len,
            }
            for name in served
        ]
        adapters: list[dict[str, Any]] = []
        if engine.ready.enable_lora:
            try:
                adapters = [lora_card(i, served[0]) for i in await engine.list_loras()]
            except (UtilityError, EngineDeadError, TimeoutError):
                adapters = []  # the base model is still worth listing
        return base + adapters

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": await cards()}

    # Served names hold slashes ("HuggingFaceTB/SmolLM2-135M-Instruct"): a path parameter.
    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Any:
        for card in await cards():
            if card["id"] == model:
                return card
        return APIError(
            404, f"The model `{model}` does not exist.", "model", "model_not_found"
        ).response()

    return router
