"""The generation routes: /v1/completions, /v1/chat/completions and the chat batch.

    POST /v1/completions
    POST /v1/chat/completions
    POST /v1/chat/completions/batch   {"requests": [chat request, ...]} → answers in order

Registered only when the engine serves the "generate" task. The handlers
live in `serving_completion.py` and `serving_chat.py`; each call here runs
as one in-flight request (`inflight.py`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from pagoda.frontend.api.common import as_api_error
from pagoda.frontend.api.errors import APIError, read_json, validation_api_error
from pagoda.frontend.api.inflight import InFlight
from pagoda.frontend.api.openai_models import ChatCompletionRequest, CompletionRequest
from pagoda.frontend.api.serving_chat import ChatServer
from pagoda.frontend.api.serving_completion import CompletionServer

MAX_BATCH = 1024
CHAT_REF = {"$ref": "#/components/schemas/ChatCompletionRequest"}
# The batch route reads its body itself; the schema still says what it takes.
_BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"requests": {"type": "array", "items": CHAT_REF}},
                    "required": ["requests"],
                }
            }
        },
    }
}


def build_router(chat: ChatServer, completions: CompletionServer, in_flight: InFlight) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Any:
        return await in_flight.counted(lambda: completions.create(body, request))

    @router.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        return await in_flight.counted(lambda: chat.create(body, request))

    @router.post("/v1/chat/completions/batch", openapi_extra=_BATCH_BODY)
    async def create_chat_batch(request: Request) -> Any:
        """A list of chat requests, answered in order; one failure fails only itself."""
        body = await read_json(request)
        items = body.get("requests") if isinstance(body, dict) else body
        if not isinstance(items, list) or not items:
            raise APIError(400, "expected a non-empty list of chat requests", "requests")
        if len(items) > MAX_BATCH:
            raise APIError(400, f"at most {MAX_BATCH} requests per batch", "requests")

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

        results = await in_flight.counted(
            lambda: asyncio.gather(*(one(i, x) for i, x in enumerate(items)))
        )
        return {"object": "list", "data": results}

    return router
