"""Input processing shared by LLM, AsyncLLM and the API server.

Turns a prompt (text, token ids, or vLLM's prompt dicts) and SamplingParams
into validated engine requests: tokenizes, checks lengths against the
engine's max_model_len, and fans a request with n samples out into n engine
requests. Without a tokenizer (an API server's --tokens-only) only token id
prompts are taken.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagoda.frontend.output_processor import child_params, child_request_id
from pagoda.frontend.tokenizer import Tokenizer
from pagoda.protocol.messages import AddRequest, LoRARequest, Ready
from pagoda.protocol.pooling_params import PoolingParams
from pagoda.protocol.sampling_params import SamplingParams, SamplingParamsError

PromptType = str | list[int] | dict[str, Any]


class PromptTooLongError(SamplingParamsError):
    """Prompt plus max_tokens does not fit the context."""


class UnsupportedTaskError(ValueError):
    """The model does not serve this task (generate on an encoder, embed on a generator)."""


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


def check_priority(priority: int) -> None:
    """The engine's queue order key crosses the socket as a signed 64-bit integer."""
    if not -(2**63) <= priority < 2**63:
        raise SamplingParamsError("priority", "priority must fit in a signed 64-bit integer")


class Processor:
    """Tokenizes and validates requests for one engine's model."""

    def __init__(self, tokenizer: Tokenizer | None, ready: Ready) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.supported_tasks = list(ready.supported_tasks)
        self.model_name = ready.model_name

    def _text_tokenizer(self) -> Tokenizer:
        """The tokenizer, for a text prompt; a client error when there is none."""
        if self.tokenizer is None:
            raise SamplingParamsError(
                "prompt", "this server has no tokenizer (--tokens-only): send token ids"
            )
        return self.tokenizer

    def check_task(self, task: str) -> None:
        if task not in self.supported_tasks:
            raise UnsupportedTaskError(
                f"The model `{self.model_name}` does not support the {task!r} task; "
                f"it supports {self.supported_tasks}"
            )

    def process_pooling_prompt(
        self, prompt: PromptType, truncate_prompt_tokens: int | None = None
    ) -> ProcessedPrompt:
        """Tokenize for pooling; truncate_prompt_tokens k keeps k tokens (-1: the context).

        Text is cut by the tokenizer (its start and special tokens kept), token
        ids keep their last k, as vLLM does.
        """
        if truncate_prompt_tokens is not None:
            if truncate_prompt_tokens == -1:
                truncate_prompt_tokens = self.max_model_len
            if not 1 <= truncate_prompt_tokens <= self.max_model_len:
                raise SamplingParamsError(
                    "truncate_prompt_tokens",
                    f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}]",
                )
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
        if text is not None and truncate_prompt_tokens is not None:
            tokenizer = self._text_tokenizer()
            return ProcessedPrompt(text, tokenizer.encode(text, True, truncate_prompt_tokens))
        processed = self.process_prompt(prompt)
        if truncate_prompt_tokens is not None:
            processed.prompt_token_ids = processed.prompt_token_ids[-truncate_prompt_tokens:]
        return processed

    def make_pooling_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: PoolingParams,
        priority: int = 0,
    ) -> AddRequest:
        """Validate a pooling request: the model embeds, the prompt fits the context."""
        self.check_task(params.task)
        check_priority(priority)
        params.validate()
        num_prompt = len(prompt.prompt_token_ids)
        if num_prompt == 0:
            raise SamplingParamsError("input", "the input is empty")
        if num_prompt > self.max_model_len:
            raise PromptTooLongError(
                "input",
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt} tokens in the input. "
                "Please reduce the length of the input (or set truncate_prompt_tokens).",
            )
        return AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt.prompt_token_ids,
            sampling_params=SamplingParams(max_tokens=1),
            arrival_time=time.time(),
            priority=priority,
            pooling_params=params,
        )

    def process_prompt(
        self, prompt: PromptType, add_special_tokens: bool = True
    ) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return ProcessedPrompt(
                prompt, self._text_tokenizer().encode(prompt, add_special_tokens)
            )
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return ProcessedPrompt(
                    prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
                )
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return self.process_prompt(prompt["prompt"], add_special_tokens)
            raise SamplingParamsError(
                "prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'"
            )
        if isinstance(prompt, list):
            return ProcessedPrompt(None, self._check_ids(prompt))
        raise SamplingParamsError("prompt", f"unsupported prompt type {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise SamplingParamsError("prompt", "token id prompts must be lists of integers")
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise SamplingParamsError(
                    "prompt", f"token id {t} is out of vocabulary (size {self.vocab_size})"
                )
        return ids

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        encoder_features: bytes | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> tuple[SamplingParams, list[AddRequest]]:
        """Validate and fan out; returns the effective params and the engine requests.
        With `encoder_features` it is a transcription request (a Whisper model)."""
        self.check_task("generate" if encoder_features is None else "transcription")
        check_priority(priority)
        num_prompt = len(prompt.prompt_token_ids)
        if num_prompt == 0:
            raise SamplingParamsError("prompt", "the prompt is empty")
        params.validate(self.vocab_size)
        if params.max_tokens is None:
            import msgspec

            params = msgspec.structs.replace(
                params, max_tokens=max(self.max_model_len - num_prompt, 1)
            )
        assert params.max_tokens is not None
        if params.min_tokens > params.max_tokens:  # validate() saw no max_tokens yet
            raise SamplingParamsError(
                "min_tokens", "min_tokens must be less than or equal to max_tokens"
            )
        if num_prompt + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                "max_tokens" if num_prompt < self.max_model_len else "messages",
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt + params.max_tokens} tokens "
                f"({num_prompt} in the messages, {params.max_tokens} in the completion). "
                f"Please reduce the length of the messages or completion.",
            )
        kv = kv_transfer_params or {}
        if params.n > 1 and (kv.get("do_remote_decode") or kv.get("do_remote_prefill")):
            raise SamplingParamsError(
                "kv_transfer_params", "a KV transfer moves one sequence's KV: n must be 1"
            )
        now = time.time()
        requests = [
            AddRequest(
                request_id=child_request_id(request_id, i, params.n),
                prompt_token_ids=prompt.prompt_token_ids,
                sampling_params=child_params(params, i),
                arrival_time=now,
                priority=priority,
                lora_request=lora_request,
                cache_salt=cache_salt,
                encoder_features=encoder_features,
                kv_transfer_params=kv_transfer_params,
            )
            for i in range(params.n)
        ]
        return params, requests
