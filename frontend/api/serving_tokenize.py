"""Prompt utilities: /tokenize, /detokenize, /tokenizer_info and the render routes.

The render routes answer what a generation request would send to the
engine (prompt text and token ids) without generating anything.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from pagoda.frontend.api.common import check_model
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.openai_models import ChatCompletionRequest, ChatMessage, CompletionRequest
from pagoda.frontend.api.serving_chat import ChatServer
from pagoda.frontend.async_llm import AsyncLLM


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(..., max_length=1_000_000)


def build_router(engine: AsyncLLM, served: list[str], chat: ChatServer) -> APIRouter:
    router = APIRouter()
    tokenizer = engine.tokenizer
    max_model_len = engine.ready.max_model_len

    def render_chat(req: ChatCompletionRequest) -> tuple[str, list[int]]:
        text = chat.render(req)
        return text, tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(engine, served, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            chat_req = ChatCompletionRequest(
                messages=req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                tools=req.tools,
                add_special_tokens=False,
            )
            _, ids = render_chat(chat_req)
        else:
            assert req.prompt is not None
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return body

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        check_model(engine, served, req.model)
        bad = next((t for t in req.tokens if not 0 <= t < engine.ready.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of vocabulary", "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "vocab_size": tokenizer.vocab_size,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "model_max_length": max_model_len,
            "chat_template": tokenizer.chat_template,
        }

    @router.post("/v1/chat/completions/render")
    async def render_chat_route(req: ChatCompletionRequest) -> dict[str, Any]:
        check_model(engine, served, req.model)
        text, ids = render_chat(req)
        return {
            "prompt": text,
            "prompt_token_ids": ids,
            "num_prompt_tokens": len(ids),
            "max_model_len": max_model_len,
        }

    @router.post("/v1/completions/render")
    async def render_completion_route(req: CompletionRequest) -> dict[str, Any]:
        check_model(engine, served, req.model)
        prompts = req.prompt
        items = (
            [prompts]
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else list(prompts)
        )
        rendered = []
        for item in items:
            processed = engine.processor.process_prompt(item, req.add_special_tokens)  # type: ignore[arg-type]
            rendered.append(
                {
                    "prompt": processed.prompt
                    if processed.prompt is not None
                    else tokenizer.decode(processed.prompt_token_ids, skip_special_tokens=False),
                    "prompt_token_ids": processed.prompt_token_ids,
                    "num_prompt_tokens": len(processed.prompt_token_ids),
                }
            )
        return {"prompts": rendered, "max_model_len": max_model_len}

    return router
