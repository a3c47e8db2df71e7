"""The routes of a task the model lacks: 400 naming the tasks it has.

An embedding model answers the generation routes this way, a generative one
the pooling and audio routes, a Whisper model (task "transcription") the
generation and pooling routes, so a client learns why instead of getting a 404.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from fastapi import APIRouter, Request, Response

from pagoda.frontend.api.errors import APIError, error_response
from pagoda.frontend.api.serving_audio import AUDIO_PATHS
from pagoda.frontend.api.serving_pooling import POOLING_PATHS
from pagoda.frontend.api.serving_scoring import SCORING_PATHS

GENERATION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/inference/v1/generate",
    *SCORING_PATHS,
)
# The routes of each task, for the model that lacks it.
TASK_PATHS = {
    "generate": GENERATION_PATHS,
    "embed": POOLING_PATHS,
    "transcription": AUDIO_PATHS,
}


def unsupported_task(model: str, task: str, tasks: Sequence[str]) -> APIError:
    return APIError(
        400, f"The model `{model}` does not support the {task!r} task; it supports {list(tasks)}"
    )


def build_router(model: str, tasks: Sequence[str]) -> APIRouter:
    """POST routes that refuse every task in TASK_PATHS missing from `tasks`."""
    router = APIRouter()
    for task, paths in TASK_PATHS.items():
        if task in tasks:
            continue
        refuse = _refusal(unsupported_task(model, task, tasks))
        for path in paths:
            router.add_api_route(path, refuse, methods=["POST"])
    return router


def _refusal(error: APIError) -> Callable[[Request], Awaitable[Response]]:
    async def refuse(request: Request) -> Response:
        return error_response(request, error)

    return refuse
