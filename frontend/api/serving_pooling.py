"""Pooling routes: /v1/embeddings, /pooling, /v1/score and rerank (vLLM's shapes).

Registered only when the engine serves the "embed" task. Each input is one
engine request; all of them go at once, so the engine batches them in one
step. Score and rerank are the cosine similarity of the two embeddings.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from pagoda.frontend.api.common import check_model, new_id, now, unless_disconnected
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.outputs import PoolingRequestOutput
from pagoda.frontend.pooling import cosine_similarity, floats_to_bytes, score_pairs
from pagoda.frontend.processor import PromptType
from pagoda.protocol.pooling_params import PoolingParams

MAX_INPUTS = 2048

PoolingInput = str | list[str] | list[int] | list[list[int]]


class _PoolingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = 0
    user: str | None = None


class EmbeddingRequest(_PoolingFields):
    """OpenAI's embeddings request, with vLLM's extras (truncate_prompt_tokens, normalize)."""

    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None


class ScoreRequest(_PoolingFields):
    """vLLM's score request: text_1 against text_2 (1:1, 1:N or N:N)."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingFields):
    """Cohere / Jina rerank: documents ordered by relevance to the query."""

    query: str
    documents: list[str]
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True


def prompts_of(value: PoolingInput, param: str = "input") -> list[PromptType]:
    """A string, strings, token ids, or lists of token ids → one prompt each."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, f"{param} must not be empty", param)
    if len(value) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request", param)
    if all(isinstance(v, int) for v in value):
        return [list(value)]  # type: ignore[arg-type]
    if any(isinstance(v, list) and not v for v in value):
        raise APIError(400, f"{param} must not hold an empty token list", param)
    return list(value)  # type: ignore[arg-type]


def usage(outputs: list[PoolingRequestOutput]) -> dict[str, int]:
    num = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": num, "total_tokens": num}


class PoolingServer:
    """Runs the pooling requests of the routes below on one AsyncLLM."""

    def __init__(self, engine: AsyncLLM, served: list[str]) -> None:
        self.engine = engine
        self.served = served

    async def pool(
        self,
        prompts: list[PromptType],
        prefix: str,
        params: PoolingParams,
        truncate: int | None,
        priority: int = 0,
    ) -> list[PoolingRequestOutput]:
        """One engine request per prompt, all in flight at once; results in order."""
        request_id = new_id(prefix)

        async def one(i: int, prompt: PromptType) -> PoolingRequestOutput:
            async for out in self.engine.encode(
                prompt, params, f"{request_id}-{i}", truncate, priority
            ):
                return out
            raise APIError(499, "request aborted")

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    def _vectors(
        self, outputs: list[PoolingRequestOutput], encoding_format: str, kind: str, key: str
    ) -> list[dict[str, Any]]:
        data = []
        for i, out in enumerate(outputs):
            vector: list[float] | str = out.outputs.data
            if encoding_format == "base64":
                vector = base64.b64encode(floats_to_bytes(out.outputs.data)).decode()
            data.append({"index": i, "object": kind, key: vector})
        return data

    async def embeddings(self, req: EmbeddingRequest, request: Request) -> dict[str, Any]:
        no_dimensions = (
            "The model `{model}` does not support matryoshka representation; "
            "dimensions cannot be set"
        )
        return await self._encode(req, request, "embd", "embedding", "embedding", no_dimensions)

    async def pooling(self, req: EmbeddingRequest, request: Request) -> dict[str, Any]:
        no_dimensions = "dimensions cannot be set for /pooling"
        return await self._encode(req, request, "pool", "pooling", "data", no_dimensions)

    async def _encode(
        self,
        req: EmbeddingRequest,
        request: Request,
        prefix: str,
        kind: str,
        key: str,
        no_dimensions: str,
    ) -> dict[str, Any]:
        """One vector per input: the shared body of /v1/embeddings and /pooling."""
        model = check_model(self.engine, self.served, req.model)
        if req.dimensions is not None:
            raise APIError(400, no_dimensions.format(model=model), "dimensions")
        prompts = prompts_of(req.input)
        params = PoolingParams(normalize=req.normalize)
        outputs = await unless_disconnected(
            request, self.pool(prompts, prefix, params, req.truncate_prompt_tokens, req.priority)
        )
        return {
            "id": new_id(prefix),
            "object": "list",
            "created": now(),
            "model": model,
            "data": self._vectors(outputs, req.encoding_format, kind, key),
            "usage": usage(outputs),
        }

    async def _scores(
        self, pairs: list[tuple[str, str]], truncate: int | None, priority: int, request: Request
    ) -> tuple[list[float], list[PoolingRequestOutput]]:
        """Cosine similarity per pair; each distinct text is embedded once."""
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outputs = await unless_disconnected(
            request, self.pool(list(texts), "score", PoolingParams(), truncate, priority)
        )
        vectors = {t: o.outputs.data for t, o in zip(texts, outputs, strict=True)}
        return [cosine_similarity(vectors[a], vectors[b]) for a, b in pairs], outputs

    async def score(self, req: ScoreRequest, request: Request) -> dict[str, Any]:
        model = check_model(self.engine, self.served, req.model)
        pairs = score_pairs(req.text_1, req.text_2)
        if len(pairs) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} pairs per request", "text_2")
        scores, outputs = await self._scores(
            pairs, req.truncate_prompt_tokens, req.priority, request
        )
        return {
            "id": new_id("score"),
            "object": "list",
            "created": now(),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": usage(outputs),
        }

    async def rerank(self, req: RerankRequest, request: Request) -> dict[str, Any]:
        model = check_model(self.engine, self.served, req.model)
        if not req.documents:
            raise APIError(400, "documents must not be empty", "documents")
        if len(req.documents) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} documents per request", "documents")
        pairs = [(req.query, d) for d in req.documents]
        scores, outputs = await self._scores(
            pairs, req.truncate_prompt_tokens, req.priority, request
        )
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if req.top_n:
            order = order[: req.top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                item["document"] = {"text": req.documents[i]}
            results.append(item)
        return {
            "id": new_id("rerank"),
            "model": model,
            "usage": {"total_tokens": usage(outputs)["total_tokens"]},
            "results": results,
        }


def build_router(server: PoolingServer, counted: Any) -> APIRouter:
    """The pooling routes; `counted` wraps each call for /load and the error shape."""
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await counted(lambda: server.embeddings(body, request))

    @router.post("/pooling")
    async def create_pooling(body: EmbeddingRequest, request: Request) -> Any:
        return await counted(lambda: server.pooling(body, request))

    @router.post("/score")
    @router.post("/v1/score")
    async def create_score(body: ScoreRequest, request: Request) -> Any:
        return await counted(lambda: server.score(body, request))

    @router.post("/rerank")
    @router.post("/v1/rerank")
    @router.post("/v2/rerank")
    async def create_rerank(body: RerankRequest, request: Request) -> Any:
        return await counted(lambda: server.rerank(body, request))

    return router


POOLING_PATHS = (
    "/v1/embeddings",
    "/pooling",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)
