"""Prompt utilities: /tokenize, /detokenize, /tokenizer_info and the render routes.

The render routes answer what a generation request would send to the engine
without generating anything, in vLLM's GenerateRequest shape (token ids and
resolved sampling params, `max_tokens` included) plus the rendered `prompt`
text: /v1/chat/completions/render one, /v1/completions/render a list, one
per prompt. Each can be POSTed to /inference/v1/generate as it is.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from pagoda.frontend.api.common import as_api_error, check_model, new_id, refresh_loras
from pagoda.frontend.api.errors import APIError
from pagoda.frontend.api.openai_models import ChatCompletionRequest, ChatMessage, CompletionRequest
from pagoda.frontend.api.serving_chat import ChatServer
from pagoda.frontend.api.serving_completion import CompletionServer
from pagoda.frontend.api.serving_tokens import render_body
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.processor import ProcessedPrompt
from pagoda.protocol.sampling_params import SamplingParams


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


def build_router(
    engine: AsyncLLM, served: list[str], chat: ChatServer, completions: CompletionServer
) -> APIRouter:
    router = APIRouter()
    max_model_len = engine.ready.max_model_len

    def render_chat(req: ChatCompletionRequest) -> tuple[str, list[int]]:
        text = chat.render(req)
        return text, engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    def generate_request(
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        req: ChatCompletionRequest | CompletionRequest,
    ) -> dict[str, Any]:
        """The GenerateRequest this prompt would be, its params as the engine gets them."""
        try:
            params, _ = engine.processor.make_requests(request_id, prompt, params, req.priority)
        except ValueError as e:  # the prompt does not fit, the model does not generate
            raise as_api_error(e) from None
        text = prompt.prompt
        if text is None:
            text = engine.tokenizer.decode(prompt.prompt_token_ids, skip_special_tokens=False)
        return render_body(
            request_id,
            text,
            prompt.prompt_token_ids,
            params,
            req.model,
            req.stream,
            req.stream_options,
            (req.model_extra or {}).get("cache_salt"),
            req.priority,
        )

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
            ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return body

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        check_model(engine, served, req.model)
        bad = next((t for t in req.tokens if not 0 <= t < engine.ready.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of vocabulary", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tokenizer = engine.tokenizer
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
        await refresh_loras(engine, served, req.model)
        check_model(engine, served, req.model)
        params, _, text, ids = chat.prepare(req)
        return generate_request(new_id("chatcmpl"), ProcessedPrompt(text, ids), params, req)

    @router.post("/v1/completions/render")
    async def render_completion_route(req: CompletionRequest) -> list[dict[str, Any]]:
        await refresh_loras(engine, served, req.model)
        check_model(engine, served, req.model)
        params, prompts = completions.prepare(req)
        return [generate_request(new_id("cmpl"), p, params, req) for p in prompts]

    return router
