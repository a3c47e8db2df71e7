"""AsyncLLM: async streaming generation against an engine-core process.

    engine = await AsyncLLM.from_engine_args(model=None)      # starts engine-core
    engine = await AsyncLLM.connect("ipc:///run/.../engine")   # or attaches
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)

The API server is built on this class. Outputs are deltas by default
(`output_kind="delta"`): each RequestOutput carries only what is new. With
`log_stats=True` it keeps Prometheus metrics (`self.metrics`, labelled with
`served_model_name`): request latencies and token counts observed as deltas
arrive, engine gauges read from the engine's stats.

Pooling models (engines whose Ready lists "embed") answer `encode`:

    async for out in engine.encode("Hello", PoolingParams(), "req-2"):
        vector = out.outputs.data                              # list[float]

Attached with `skip_tokenizer_init=True` (the API server's --tokens-only) it
loads no tokenizer: prompts must be token ids and outputs carry token ids
only, with no text.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagoda.frontend.dp_client import DPClient
from pagoda.frontend.engine_client import AsyncMPClient, EngineDeadError
from pagoda.frontend.metrics import FrontendMetrics
from pagoda.frontend.output_processor import OutputKind, RequestState
from pagoda.frontend.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pagoda.frontend.pooling import floats_from_bytes
from pagoda.frontend.processor import Processor, PromptType
from pagoda.frontend.tokenizer import Tokenizer
from pagoda.protocol.messages import LoRARequest, RequestDelta
from pagoda.protocol.pooling_params import PoolingParams
from pagoda.protocol.sampling_params import SamplingParams, SamplingParamsError

DeltaQueue = asyncio.Queue[tuple[int, RequestDelta | None, float]]


def _enqueue(queue: DeltaQueue, index: int) -> Callable[[RequestDelta | None], None]:
    """A delta handler that tags deltas with their sample index and arrival time."""
    return lambda delta: queue.put_nowait((index, delta, time.monotonic()))


class EngineRequestError(ValueError):
    """The engine refused a request (its message says why)."""


class NoTokenizerError(RuntimeError):
    """Something needed the tokenizer of an AsyncLLM attached without one."""


class EngineUnavailableError(RuntimeError):
    """The engine cannot take the request now (asleep, overloaded, queue wait); retry later."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


SLEEPING_MESSAGE = "the engine is sleeping; POST /wake_up to serve again"


class AsyncLLM:
    """Streams generations from one engine core; many requests at once."""

    def __init__(
        self,
        client: AsyncMPClient | DPClient,
        tokenizer: Tokenizer | None,
        engine_process: subprocess.Popen[bytes] | None = None,
        metrics: FrontendMetrics | None = None,
    ) -> None:
        assert client.ready is not None
        self.client = client
        self.ready = client.ready
        self._tokenizer = tokenizer
        self.processor = Processor(tokenizer, client.ready)
        self.model_name = client.ready.model_name
        # Adapters by model name, as this server last heard from the engine.
        self.loras: dict[str, LoRARequest] = {r.lora_name: r for r in client.ready.loras}
        self._engine_process = engine_process
        # request id -> (engine request ids, the queue its deltas arrive on)
        self._active: dict[str, tuple[list[str], DeltaQueue]] = {}
        self.metrics = metrics

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer; NoTokenizerError when attached without one."""
        if self._tokenizer is None:
            raise NoTokenizerError("this server has no tokenizer (--tokens-only)")
        return self._tokenizer

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    # ------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        address: str,
        chat_template: str | None = None,
        timeout: float = 120.0,
        curve_dir: str | None = None,
        log_stats: bool = False,
        served_model_name: str | None = None,
        skip_tokenizer_init: bool = False,
        elastic: bool = False,
    ) -> AsyncLLM:
        """Attach to a running engine core (`curve_dir`: its CURVE keys, for tcp);
        `skip_tokenizer_init`: load no tokenizer (token ids in and out only);
        `elastic`: engine cores come and go while serving (frontend/elastic.py)."""
        # Several comma-separated addresses: data-parallel engine cores.
        addresses = [a.strip() for a in address.split(",") if a.strip()]
        client: AsyncMPClient | DPClient
        if len(addresses) > 1 or elastic:
            client = DPClient(addresses, curve_dir=curve_dir, elastic=elastic)
        else:
            client = AsyncMPClient(address, curve_dir=curve_dir)
        ready = await client.start(timeout=timeout)
        tokenizer = None
        if not skip_tokenizer_init:
            tokenizer = await asyncio.to_thread(Tokenizer, ready.tokenizer_path, chat_template)
        metrics = None
        if log_stats:
            metrics = FrontendMetrics.of_engine(client, served_model_name or ready.model_name)
        return cls(client, tokenizer, metrics=metrics)

    @classmethod
    async def from_engine_args(
        cls,
        model: str | None = None,
        chat_template: str | None = None,
        startup_timeout: float = 300.0,
        log_stats: bool = False,
        **engine_args: Any,
    ) -> AsyncLLM:
        """Start an engine-core child process with these args and attach to it."""
        from pagoda.protocol.addresses import default_ipc_address

        address = default_ipc_address()
        argv = [sys.executable, "-m", "pagoda.engine_core.cli", "--address", address]
        if model is not None:
            argv += ["--model", model]
        for key, value in engine_args.items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                argv += [flag, str(value)]
        process = subprocess.Popen(argv, env=os.environ.copy())
        try:
            client = AsyncMPClient(address)
            ready = await client.start(timeout=startup_timeout)
        except EngineDeadError:
            process.terminate()
            raise
        tokenizer = await asyncio.to_thread(Tokenizer, ready.tokenizer_path, chat_template)
        metrics = FrontendMetrics.of_engine(client, ready.model_name) if log_stats else None
        return cls(client, tokenizer, process, metrics)

    async def shutdown(self) -> None:
        await self.client.close()
        if self._engine_process is not None:
            self._engine_process.terminate()
            try:
                await asyncio.to_thread(self._engine_process.wait, 10)
            except subprocess.TimeoutExpired:
                self._engine_process.kill()
            self._engine_process = None

    @property
    def is_dead(self) -> bool:
        return self.client.dead is not None

    # ------------------------------------------------------------- requests

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        output_kind: OutputKind = "delta",
        add_special_tokens: bool = True,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as they come; aborts the engine request if the caller stops."""
        processed = self.processor.process_prompt(prompt, add_special_tokens)
        async for out in self.generate_tokens(
            processed.prompt,
            processed.prompt_token_ids,
            sampling_params,
            request_id,
            output_kind,
            priority,
            lora_request,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
        ):
            yield out

    async def generate_tokens(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        output_kind: OutputKind = "delta",
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        detokenize: bool = True,
        cache_salt: str | None = None,
        encoder_features: bytes | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Generate from token ids; `detokenize=False` (or no tokenizer): outputs
        carry token ids and no text, and stop strings are refused. With
        `encoder_features` (a Whisper model's log-mel window, `AddRequest`'s
        field) the prompt is the decoder's, and the task is "transcription"."""
        from pagoda.frontend.processor import ProcessedPrompt

        tokenizer = self._tokenizer if detokenize else None
        if tokenizer is None and sampling_params.stop:
            why = "detokenize=true" if self.has_tokenizer else "a tokenizer (--tokens-only)"
            raise SamplingParamsError("stop", f"stop strings need {why}; use stop_token_ids")
        if request_id in self._active:
            raise EngineRequestError(f"request id {request_id!r} is already in use")
        if self.client.stats.is_sleeping:
            # Known from the engine's last stats; the engine refuses too, should it be stale.
            raise EngineUnavailableError(SLEEPING_MESSAGE, "sleeping")
        params, requests = self.processor.make_requests(
            request_id,
            ProcessedPrompt(prompt, prompt_token_ids),
            sampling_params,
            priority,
            lora_request,
            cache_salt,
            encoder_features,
            kv_transfer_params,
        )
        state = RequestState(request_id, prompt, prompt_token_ids, params, tokenizer, output_kind)
        queue: DeltaQueue = asyncio.Queue()
        child_ids = [r.request_id for r in requests]
        started = time.monotonic()
        last_token_at: list[float | None] = [None] * len(requests)
        self._active[request_id] = (child_ids, queue)
        try:
            for index, request in enumerate(requests):
                await self.client.add_request(request, _enqueue(queue, index))
            while not state.finished:
                batch = [await queue.get()]
                while not queue.empty():  # fold everything already here into one output
                    batch.append(queue.get_nowait())
                for index, delta, arrived in batch:
                    if index < 0:  # aborted through abort()
                        state.finish_all("abort")
                        break
                    if delta is None:
                        raise EngineDeadError(self.client.dead or "the engine core died")
                    if delta.error is not None:
                        if delta.error_kind is not None:
                            raise EngineUnavailableError(delta.error, delta.error_kind)
                        raise EngineRequestError(delta.error)
                    if self.metrics is not None and delta.timings is not None:
                        self.metrics.observe_engine_timings(delta.timings)
                    if self.metrics is not None and delta.new_token_ids:
                        last = last_token_at[index]
                        if last is None:
                            self.metrics.observe_first_token(arrived - started)
                        else:
                            self.metrics.observe_inter_token(arrived - last)
                        last_token_at[index] = arrived
                    if state.apply(index, delta):
                        await self.client.abort([child_ids[index]])
                if state.finished and self.metrics is not None:
                    self.metrics.observe_finished(
                        time.monotonic() - started,
                        len(prompt_token_ids),
                        sum(len(sample.token_ids) for sample in state.samples),
                        [sample.finish_reason or "abort" for sample in state.samples],
                    )
                output = state.make_output()
                if output is not None:
                    yield output
        finally:
            del self._active[request_id]
            unfinished = [
                cid for i, cid in enumerate(child_ids) if state.samples[i].finish_reason is None
            ]
            for cid in child_ids:
                self.client.forget(cid)
            if unfinished and self.client.dead is None:
                # The caller went away (disconnect, cancel): free the engine's blocks now.
                await self.client.abort(unfinished)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None,
        request_id: str,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Pool one prompt; yields one finished output (vLLM's shape), then stops."""
        if request_id in self._active:
            raise EngineRequestError(f"request id {request_id!r} is already in use")
        processed = self.processor.process_pooling_prompt(prompt, truncate_prompt_tokens)
        request = self.processor.make_pooling_request(
            request_id, processed, pooling_params or PoolingParams(), priority
        )
        queue: DeltaQueue = asyncio.Queue()
        started = time.monotonic()
        finished = False
        self._active[request_id] = ([request_id], queue)
        try:
            await self.client.add_request(request, _enqueue(queue, 0))
            index, delta, _ = await queue.get()
            if index < 0:
                return  # aborted through abort()
            if delta is None:
                raise EngineDeadError(self.client.dead or "the engine core died")
            finished = True
            if delta.error is not None:
                raise EngineRequestError(delta.error)
            if delta.pooled is None:
                raise EngineRequestError("the engine returned no pooled vector")
            if self.metrics is not None:
                self.metrics.observe_finished(
                    time.monotonic() - started, len(processed.prompt_token_ids), 0, ["stop"]
                )
            yield PoolingRequestOutput(
                request_id,
                processed.prompt,
                processed.prompt_token_ids,
                PoolingOutput(floats_from_bytes(delta.pooled)),
            )
        finally:
            del self._active[request_id]
            self.client.forget(request_id)
            if not finished and self.client.dead is None:
                await self.client.abort([request_id])

    async def abort(self, request_id: str) -> None:
        active = self._active.get(request_id)
        if active is not None:
            child_ids, queue = active
            await self.client.abort(child_ids)
            queue.put_nowait((-1, None, time.monotonic()))

    @property
    def active_request_ids(self) -> set[str]:
        """The ids of the requests being generated for this process's callers now."""
        return set(self._active)

    @property
    def num_active(self) -> int:
        """Requests being generated for this process's callers now."""
        return len(self._active)

    async def abort_all(self) -> int:
        """Abort every active request (shutdown); returns how many."""
        request_ids = list(self._active)
        for request_id in request_ids:
            await self.abort(request_id)
        return len(request_ids)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility("reset_prefix_cache"))

    async def start_profile(self) -> None:
        await self.client.call_utility("start_profile")

    async def stop_profile(self) -> str:
        """Returns the trace file's path (on the engine's machine)."""
        return str(await self.client.call_utility("stop_profile"))

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache and park (1) or drop (2) the weights; refused mid-request."""
        await self.client.call_utility("sleep", level)
        self.note_sleeping(True)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or KV cache ("weights", "kv_cache"; all by default)."""
        await self.client.call_utility("wake_up", tags)
        self.note_sleeping(bool(await self.client.call_utility("is_sleeping")))

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None:
        """Stop generating ("abort" | "wait" | "keep"); with "wait", returns once
        the admitted requests have finished."""
        await self.client.call_utility("pause", mode, clear_cache)
        if mode == "wait":
            while (await self.client.call_utility("pause_state"))["num_unfinished"]:
                await asyncio.sleep(0.05)

    async def resume_generation(self) -> None:
        await self.client.call_utility("resume")

    async def is_paused(self) -> bool:
        return bool(await self.client.call_utility("is_paused"))

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self.client.call_utility("init_weight_transfer_engine", init_info)

    async def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        return dict(await self.client.call_utility("update_weights", update_info))

    async def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """A control call of protocol/control.py on the engine(s), one result
        per engine core (what POST /collective_rpc sends)."""
        client = self.client
        if isinstance(client, DPClient):
            return list(await client.call_utility_all(method, *args, kwargs=kwargs))
        return [await client.call_utility(method, *args, kwargs=kwargs)]

    async def is_sleeping(self) -> bool:
        asleep = bool(await self.client.call_utility("is_sleeping"))
        self.note_sleeping(asleep)
        return asleep

    def note_sleeping(self, asleep: bool) -> None:
        """Keep this server's view of the engine(s) in step without waiting for stats."""
        clients = self.client.clients if isinstance(self.client, DPClient) else [self.client]
        for client in clients:
            client.stats.is_sleeping = asleep

    # ------------------------------------------------------------------ LoRA

    async def add_lora(self, lora_request: LoRARequest) -> dict[str, Any]:
        """Register an adapter with the engine; UtilityError (kind not_found/invalid) if bad."""
        r = lora_request
        info = await self.client.call_utility("add_lora", r.lora_name, r.lora_path, r.lora_int_id)
        self.loras[r.lora_name] = LoRARequest(r.lora_name, info["lora_int_id"], info["lora_path"])
        return dict(info)

    async def remove_lora(self, lora_name: str) -> None:
        await self.client.call_utility("remove_lora", lora_name)
        self.loras.pop(lora_name, None)

    async def pin_lora(self, lora_name: str) -> None:
        await self.client.call_utility("pin_lora", lora_name)

    async def list_loras(self) -> list[dict[str, Any]]:
        """The engine's adapters (name, id, path, rank, pinned, slot); refreshes `loras`."""
        if not self.ready.enable_lora:
            return []
        infos = list(await self.client.call_utility("list_loras"))
        self.loras = {
            d["lora_name"]: LoRARequest(d["lora_name"], d["lora_int_id"], d["lora_path"])
            for d in infos
        }
        return infos

    async def get_stats(self) -> dict[str, Any]:
        """The engine's stats; with data parallel, summed over the engines (each under
        "engines")."""
        return dict(await self.client.call_utility("get_stats"))

    async def check_health(self) -> bool:
        if self.client.dead is not None:
            return False
        try:
            return await self.client.call_utility("ping") == "pong"
        except (EngineDeadError, RuntimeError, TimeoutError):
            return False
