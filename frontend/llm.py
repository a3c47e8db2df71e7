"""LLM: the offline batch SDK (vLLM's `LLM`).

    from pagoda import LLM, SamplingParams
    llm = LLM()                      # the default model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

The engine runs in this process behind the same client interface that the
API server uses over ZeroMQ. Embedding models answer `embed`, `encode` and
`score` instead (vLLM's return shapes):

    llm = LLM("path/to/all-MiniLM-L6-v2")
    llm.embed(["Hello"])[0].outputs.embedding         # list[float]
    llm.score("a cat", ["a dog", "a car"])[0].outputs.score   # cosine similarity
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagoda.frontend.chat_render import render_chat
from pagoda.frontend.engine_client import InprocClient
from pagoda.frontend.output_processor import RequestState
from pagoda.frontend.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.frontend.pooling import cosine_similarity, floats_from_bytes, score_pairs
from pagoda.frontend.processor import Processor, PromptType
from pagoda.frontend.tokenizer import Tokenizer
from pagoda.protocol.messages import LoRARequest
from pagoda.protocol.pooling_params import PoolingParams
from pagoda.protocol.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate for many prompts at once with continuous batching."""

    def __init__(
        self, model: str | None = None, *, chat_template: str | None = None, **engine_args: Any
    ) -> None:
        from pagoda.engine_core.config import EngineConfig

        self.client = InprocClient(EngineConfig(model=model, **engine_args))
        self.ready = self.client.ready
        self.tokenizer = Tokenizer(self.ready.tokenizer_path, chat_template)
        self.processor = Processor(self.tokenizer, self.ready)
        self._ids = itertools.count()

    @property
    def engine(self) -> Any:
        return self.client.engine

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; with `lora_request`, through that adapter."""
        prompt_list = _as_prompt_list(prompts)
        return self._run(
            prompt_list, sampling_params, use_tqdm, add_special_tokens=True, lora=lora_request
        )

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation as the server's chat route does
        (frontend/chat_render.py: text parts flattened, tool-call arguments
        parsed), then generate."""
        conversations: Sequence[ChatMessages]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = messages  # type: ignore[assignment]
        prompts: list[PromptType] = [
            render_chat(
                self.tokenizer,
                conv,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conv in conversations
        ]
        # The template already holds the special tokens.
        return self._run(
            prompts, sampling_params, use_tqdm, add_special_tokens=False, lora=lora_request
        )

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """One pooled vector per prompt (`.outputs.data`), in order, batched by the engine."""
        params = pooling_params or PoolingParams()
        processed = [
            self.processor.process_pooling_prompt(p, truncate_prompt_tokens)
            for p in _as_prompt_list(prompts)
        ]
        requests = [
            self.processor.make_pooling_request(str(next(self._ids)), p, params) for p in processed
        ]
        vectors: dict[str, list[float]] = {}
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm)
        try:
            for request in requests:
                self.client.add_request(request)
            while len(vectors) < len(requests):
                if not self.client.has_work():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for delta in self.client.get_outputs():
                    if delta.error is not None:
                        raise ValueError(delta.error)
                    if delta.pooled is not None:
                        vectors[delta.request_id] = floats_from_bytes(delta.pooled)
                        bar.update(1)
        except BaseException:
            self.client.abort([r.request_id for r in requests])
            raise
        finally:
            bar.close()
        return [
            PoolingRequestOutput(
                r.request_id, p.prompt, p.prompt_token_ids, PoolingOutput(vectors[r.request_id])
            )
            for r, p in zip(requests, processed, strict=True)
        ]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt: `.outputs.embedding`."""
        return [
            EmbeddingRequestOutput(
                o.request_id, o.prompt, o.prompt_token_ids, EmbeddingOutput(o.outputs.data)
            )
            for o in self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens)
        ]

    def score(
        self,
        text_1: str | list[str],
        text_2: str | list[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Cosine similarity of embeddings per pair (one with N, or N with N)."""
        pairs = score_pairs(text_1, text_2)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outs = self.embed(texts, None, use_tqdm, truncate_prompt_tokens)
        by_text = dict(zip(texts, outs, strict=True))
        results = []
        for a, b in pairs:
            ea, eb = by_text[a], by_text[b]
            results.append(
                ScoringRequestOutput(
                    f"{ea.request_id}_{eb.request_id}",
                    ea.prompt_token_ids + eb.prompt_token_ids,
                    ScoringOutput(cosine_similarity(ea.outputs.embedding, eb.outputs.embedding)),
                )
            )
        return results

    def reset_prefix_cache(self) -> bool:
        return bool(self.client.call_utility("reset_prefix_cache"))

    def start_profile(self) -> None:
        """Start a torch.profiler trace (needs profiler_dir=... at construction)."""
        self.client.call_utility("start_profile")

    def stop_profile(self) -> str:
        """Stop the trace; returns the path of the trace file (Perfetto/Chrome)."""
        return str(self.client.call_utility("stop_profile"))

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and park (level 1) or drop (level 2) the weights."""
        self.client.call_utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache ("weights", "kv_cache"; all by default)."""
        self.client.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return bool(self.client.call_utility("is_sleeping"))

    # ------------------------------------------------------------ RL training

    def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None:
        """Stop generating: "abort" ends requests now, "wait" lets them finish,
        "keep" freezes them until resume_generation (engine_core/core/training.py)."""
        self.client.call_utility("pause", mode, clear_cache)
        if mode == "wait":
            while self.client.call_utility("pause_state")["num_unfinished"]:
                self.client.get_outputs()  # nobody is reading them in between

    def resume_generation(self) -> None:
        self.client.call_utility("resume")

    def is_paused(self) -> bool:
        return bool(self.client.call_utility("is_paused"))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's group: {master_address, master_port, rank_offset, world_size}."""
        self.client.call_utility("init_weight_transfer_engine", init_info)

    def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Load the tensors the trainer broadcasts ({names, dtype_names, shapes}),
        or a safetensors file or directory ({"path"}); returns the new weight version."""
        return dict(self.client.call_utility("update_weights", update_info))

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call a worker method on every rank (vLLM's LLM.collective_rpc); results by rank."""
        return self.client.engine.executor.collective_rpc(method, tuple(args), kwargs)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (vLLM's LLM.add_lora); requests may also name it by path."""
        self.client.call_utility(
            "add_lora", lora_request.lora_name, lora_request.lora_path, lora_request.lora_int_id
        )
        return True

    def remove_lora(self, lora_name: str) -> bool:
        return bool(self.client.call_utility("remove_lora", lora_name))

    def pin_lora(self, lora_name: str) -> bool:
        return bool(self.client.call_utility("pin_lora", lora_name))

    def list_loras(self) -> list[dict[str, Any]]:
        return list(self.client.call_utility("list_loras"))

    def _run(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        add_special_tokens: bool,
        lora: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("the number of sampling params must match the number of prompts")

        states: dict[str, RequestState] = {}
        routes: dict[str, tuple[RequestState, int]] = {}
        order: list[str] = []
        # Validate everything before anything reaches the engine.
        pending = []
        for prompt, params in zip(prompts, params_list, strict=True):
            request_id = str(next(self._ids))
            processed = self.processor.process_prompt(prompt, add_special_tokens)
            params, requests = self.processor.make_requests(
                request_id, processed, params, lora_request=lora
            )
            state = RequestState(
                request_id,
                processed.prompt,
                processed.prompt_token_ids,
                params,
                self.tokenizer,
                "final",
            )
            pending.append((state, requests))
        for state, requests in pending:
            states[state.request_id] = state
            order.append(state.request_id)
            for index, request in enumerate(requests):
                routes[request.request_id] = (state, index)
                self.client.add_request(request)

        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(results) < len(order):
                if not self.client.has_work():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for delta in self.client.get_outputs():
                    route = routes.get(delta.request_id)
                    if route is None:
                        continue
                    state, index = route
                    if delta.error is not None:
                        raise ValueError(delta.error)
                    if state.apply(index, delta):  # a stop string matched
                        self.client.abort([delta.request_id])
                    if state.finished and state.request_id not in results:
                        output = state.make_output()
                        assert output is not None
                        results[state.request_id] = output
                        bar.update(1)
        except BaseException:
            self.client.abort(list(routes))
            raise
        finally:
            bar.close()
        return [results[request_id] for request_id in order]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt of token ids
    return list(prompts)  # type: ignore[arg-type]
