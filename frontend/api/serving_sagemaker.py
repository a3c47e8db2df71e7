"""SageMaker's POST /invocations: one route, dispatched by the body's shape.

A body with `messages` is a chat request, with `prompt` a completions
request, with `input` an embeddings request; each runs as the route of its
own would, counted as in flight. A task the model lacks is a 400 naming
the tasks it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from pagoda.frontend.api.errors import APIError, read_json, validation_api_error
from pagoda.frontend.api.inflight import InFlight
from pagoda.frontend.api.openai_models import ChatCompletionRequest, CompletionRequest
from pagoda.frontend.api.serving_chat import ChatServer
from pagoda.frontend.api.serving_completion import CompletionServer
from pagoda.frontend.api.serving_generation import CHAT_REF
from pagoda.frontend.api.serving_pooling import EmbeddingRequest, PoolingServer
from pagoda.frontend.api.serving_refusals import unsupported_task

_INVOCATIONS_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {"anyOf": [CHAT_REF, {"$ref": "#/components/schemas/CompletionRequest"}]}
            }
        },
    }
}


def build_router(
    model: str,
    tasks: Sequence[str],
    chat: ChatServer,
    completions: CompletionServer,
    pooling: PoolingServer | None,
    in_flight: InFlight,
) -> APIRouter:
    """/invocations; generation bodies are refused unless `tasks` holds "generate"."""
    router = APIRouter()
    generates = "generate" in tasks

    # The route reads its body itself; the schema still says what it takes.
    @router.post("/invocations", openapi_extra=_INVOCATIONS_BODY)
    async def invocations(request: Request) -> Any:
        """SageMaker: dispatch by the body's shape to chat, completions or embeddings."""
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            if "messages" in body or "prompt" in body:
                if not generates:
                    raise unsupported_task(model, "generate", tasks)
                if "messages" in body:
                    chat_req = ChatCompletionRequest.model_validate(body)
                    return await in_flight.counted(lambda: chat.create(chat_req, request))
                comp_req = CompletionRequest.model_validate(body)
                return await in_flight.counted(lambda: completions.create(comp_req, request))
            if "input" in body and pooling is not None:
                embed_req = EmbeddingRequest.model_validate(body)
                return await in_flight.counted(lambda: pooling.embeddings(embed_req, request))
        except ValidationError as e:
            raise validation_api_error(e) from None
        raise APIError(
            400, "expected a chat (messages), completions (prompt) or embeddings (input) body"
        )

    return router
