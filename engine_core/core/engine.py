"""EngineCore: the scheduler, the block manager and the executor, one step at a time.

No sockets and no text here: requests come in as token ids, outputs go out
as per-request deltas. The socket process (server.py) and the in-process
client of the offline SDK both drive this class.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from concurrent.futures import wait
from dataclasses import dataclass, replace

from pagoda.engine_core.config import EngineConfig, default_max_num_batched_tokens
from pagoda.engine_core.core.block_manager import BlockManager, cdiv
from pagoda.engine_core.core.engine_utilities import EngineUtilities
from pagoda.engine_core.core.kv_connector import (
    KVTransferError,
    PeerConnector,
    advertised_host,
    parse_kv_transfer_config,
    prompt_digest,
    remote_prefill_params,
)
from pagoda.engine_core.core.kv_offload import HostTier, offloading_bytes, offloading_disk
from pagoda.engine_core.core.lora_manager import LoRAManager, WorkerLoRA
from pagoda.engine_core.core.plan import GrammarBitmask, SchedulePlan, StepResult
from pagoda.engine_core.core.request import Request
from pagoda.engine_core.core.scheduler import Scheduler
from pagoda.engine_core.core.spec_decode import SpeculativeConfig, parse_speculative_config
from pagoda.engine_core.core.training import TrainingControls
from pagoda.engine_core.executor import create_executor, device_type
from pagoda.engine_core.model_config import (
    DEFAULT_MODEL_NAME,
    ModelConfig,
    load_model_config,
    resolve_model_path,
    supported_tasks,
)
from pagoda.engine_core.structured_output.manager import (
    StructuredOutputManager,
    advance_matcher,
    fill_grammar_bitmask,
    new_matcher,
)
from pagoda.engine_core.tokenizer_files import tokenizer_dir_for
from pagoda.protocol.messages import (
    PROTOCOL_VERSION,
    AddRequest,
    Ready,
    RequestDelta,
    SchedulerStats,
)

logger = logging.getLogger(__name__)


# Speculative decoding on the CPU: no drafts past this many tokens in a step
# (decoding requests and drafts). The default model's linears cost about the
# same up to a few dozen rows (the weights are read once a step, ~10 ms,
# against ~0.5 ms of arithmetic a row), so drafts there are nearly free; in
# larger steps every row costs its arithmetic and rejected drafts are lost
# work (c=64 on random prompts lost ~9% of output with drafts at every
# step, docs/benchmarks.md).
CPU_MAX_STEP_TOKENS_WITH_DRAFTS = 32


@dataclass(frozen=True)
class EngineInfo:
    """Facts found while starting the engine, passed on (never written into config)."""

    model_name: str
    model_path: str
    tokenizer_path: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    eos_token_ids: tuple[int, ...]
    supported_tasks: tuple[str, ...] = ("generate",)


class EngineCore(EngineUtilities, TrainingControls):
    """One engine: add requests, step, read deltas; control calls in EngineUtilities."""

    def __init__(self, config: EngineConfig) -> None:
        started = time.monotonic()
        self.config = config
        self.engine_id = uuid.uuid4().hex[:8]
        self._profiling = False
        # Sleep mode: which of SLEEP_TAGS are out of memory now.
        self._asleep: set[str] = set()
        model_path = resolve_model_path(config.model)
        self.model_config: ModelConfig = load_model_config(model_path)
        tasks = supported_tasks(self.model_config, config.runner)
        budget = config.max_num_batched_tokens
        if budget is None:
            budget = default_max_num_batched_tokens(tasks == ["embed"], device_type(config))
            self.config = config = replace(config, max_num_batched_tokens=budget)
        self.max_num_batched_tokens: int = budget
        self.executor = create_executor(config, self.model_config)
        worker = self.executor.collective_rpc("describe")[0]
        num_blocks = self.executor.initialize_kv_cache()
        max_model_len = self._max_model_len(num_blocks, pooling_only=tasks == ["embed"])
        # An encoder's blocks are bookkeeping only: nothing there to find again; a
        # Whisper decoder's cached tokens depend on their request's audio.
        prefix_caching = (
            config.enable_prefix_caching
            and not self.model_config.is_encoder
            and self.model_config.whisper is None
        )
        self.lora = self._start_lora()
        host_tier = self._start_host_tier(prefix_caching)
        self.scheduler = Scheduler(
            BlockManager(num_blocks, config.block_size, prefix_caching, host_tier),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            lora_slots=self.lora.slots if self.lora is not None else None,
            sends_token_ids=config.pipeline_parallel_size > 1,
            pipeline_depth=config.pipeline_parallel_size,
            speculative=self._speculative_config(),
            max_step_tokens_with_drafts=(
                CPU_MAX_STEP_TOKENS_WITH_DRAFTS if device_type(config) == "cpu" else None
            ),
        )
        self.peer = self._start_peer()
        self.scheduler.connector = self.peer
        # Plans submitted to the executor whose results are not back yet (more
        # than one only with pipeline stages to keep busy).
        self._in_flight: deque[SchedulePlan] = deque()
        self._init_training(device_type(config))
        name = config.served_model_name or (
            DEFAULT_MODEL_NAME if config.model is None else config.model
        )
        self.structured_output = StructuredOutputManager(
            tokenizer_dir_for(model_path),
            self.model_config.vocab_size,
            list(self.model_config.eos_token_ids),
            compile_timeout_s=config.grammar_compile_timeout_s,
        )  # starts its compile processes at the first constrained request (or start())
        # Requests whose grammar is compiling; the manager enforces the time limit.
        self._compiling: dict[str, Request] = {}
        self.info = EngineInfo(
            model_name=name,
            model_path=model_path,
            tokenizer_path=tokenizer_dir_for(model_path),
            max_model_len=max_model_len,
            vocab_size=self.model_config.vocab_size,
            num_kv_blocks=num_blocks,
            eos_token_ids=self.model_config.eos_token_ids,
            supported_tasks=tuple(tasks),
        )
        logger.info(
            "engine %s: tasks %s%s",
            self.engine_id,
            tasks,
            f", pooling {worker.pooler}" if "embed" in tasks else "",
        )
        logger.info(
            "engine %s ready in %.1f s: %s, dtype %s, %d KV blocks of %d, max_model_len %d",
            self.engine_id,
            time.monotonic() - started,
            model_path,
            worker.dtype,
            num_blocks,
            config.block_size,
            max_model_len,
        )

    def _speculative_config(self) -> SpeculativeConfig | None:
        """--speculative-config where drafts can be verified: not under pipeline
        parallelism, not for Whisper or pooling models (they run without)."""
        spec = parse_speculative_config(self.config.speculative_config)
        if spec is None:
            return None
        if (
            self.config.pipeline_parallel_size > 1
            or self.model_config.whisper is not None
            or self.model_config.is_encoder
        ):
            logger.warning("--speculative-config: this engine runs without speculative decoding")
            return None
        return spec

    def _start_lora(self) -> LoRAManager | None:
        """The adapter registry with the --lora-modules registered (None without LoRA)."""
        if not self.config.enable_lora:
            return None
        if self.model_config.is_encoder:
            raise ValueError("LoRA adapters are supported on Llama-family decoders only")
        manager = LoRAManager(WorkerLoRA(self.executor), self.config.max_loras)
        for name, path in self.config.lora_modules:
            manager.add(name, path)
        return manager

    def _max_model_len(self, num_blocks: int, pooling_only: bool) -> int:
        capacity = num_blocks * self.config.block_size
        limit = self.model_config.max_position_embeddings
        if pooling_only:
            # Pooling prompts are computed whole in one step, never chunked.
            capacity = min(capacity, self.max_num_batched_tokens)
            encoder = self.model_config.encoder
            if encoder is not None and encoder.max_seq_length and self.config.max_model_len is None:
                limit = min(limit, encoder.max_seq_length)  # sentence-transformers' limit
        if self.config.max_model_len is not None:
            if self.config.max_model_len > limit:
                raise ValueError(
                    f"max_model_len {self.config.max_model_len} exceeds the model's "
                    f"max_position_embeddings {limit}"
                )
            if self.config.max_model_len > capacity:
                raise ValueError(
                    f"max_model_len {self.config.max_model_len} needs more KV cache than the "
                    f"budget allows ({capacity} tokens); raise kv_cache_memory_bytes"
                    + (" or max_num_batched_tokens" if pooling_only else "")
                )
            return self.config.max_model_len
        return min(limit, capacity)

    def ready_message(self) -> Ready:
        info = self.info
        return Ready(
            engine_id=self.engine_id,
            protocol_version=PROTOCOL_VERSION,
            model_name=info.model_name,
            model_path=info.model_path,
            tokenizer_path=info.tokenizer_path,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=self.config.block_size,
            num_kv_blocks=info.num_kv_blocks,
            eos_token_ids=list(info.eos_token_ids),
            supported_tasks=list(info.supported_tasks),
            hidden_size=self.model_config.hidden_size,
            enable_lora=self.lora is not None,
            loras=self.lora.requests() if self.lora is not None else [],
        )

    # --------------------------------------------------------------- requests

    def add_request(self, msg: AddRequest, client_id: str = "") -> RequestDelta | None:
        """Queue a request; a delta with an error if it can never run."""
        refusal = self._refusal()
        if refusal is not None:
            kind, reason = refusal
            return RequestDelta(
                msg.request_id, [], finish_reason="error", error=reason, error_kind=kind
            )
        error = self._validate(msg)
        lora_name, lora_id = None, 0
        if error is None and msg.lora_request is not None:
            error, lora_name, lora_id = self._resolve_lora(msg)
        if error is not None:
            return RequestDelta(msg.request_id, [], finish_reason="error", error=error)
        request = Request(
            request_id=msg.request_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling_params=msg.sampling_params,
            eos_token_ids=list(self.info.eos_token_ids),
            arrival_time=msg.arrival_time,
            client_id=client_id,
            priority=msg.priority,
            lora_name=lora_name,
            pooling_params=msg.pooling_params,
            lora_id=lora_id,
            cache_salt=msg.cache_salt,
            encoder_features=msg.encoder_features,
            kv_transfer_params=msg.kv_transfer_params,
        )
        constraint = msg.sampling_params.structured_outputs
        if constraint is not None and msg.pooling_params is None:
            request.grammar = self.structured_output.compile_async(constraint)
            self._compiling[request.request_id] = request
        self._hold(request)
        self.scheduler.add_request(request)
        return None

    def _resolve_lora(self, msg: AddRequest) -> tuple[str | None, str | None, int]:
        """(error, adapter name, registration id) of a request that names an adapter."""
        assert msg.lora_request is not None
        if self.lora is None:
            return "LoRA adapters are not enabled: start the engine with --enable-lora", None, 0
        if msg.pooling_params is not None:
            return "pooling requests cannot use a LoRA adapter", None, 0
        try:
            entry = self.lora.resolve(msg.lora_request)
        except ValueError as e:
            return str(e), None, 0
        error = self.lora.check_runnable(entry.name)
        return error, entry.name, entry.lora_id

    def _refusal(self) -> tuple[str, str] | None:
        """(error kind, message) when no new request can be taken now; a client may retry."""
        if self._asleep:
            return "sleeping", "the engine is sleeping; POST /wake_up to serve again"
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            return (
                "overloaded",
                f"the server is overloaded: {limit} requests are already waiting; retry later",
            )
        return None

    def _validate(self, msg: AddRequest) -> str | None:
        if msg.request_id in self.scheduler.requests:
            return f"request id {msg.request_id!r} is already in use"
        task = "generate" if msg.encoder_features is None else "transcription"
        if msg.pooling_params is not None:
            task = msg.pooling_params.task
        tasks = self.info.supported_tasks
        if task not in tasks:
            return f"this model does not support the {task!r} task; it supports {list(tasks)}"
        if msg.encoder_features is not None:
            error = self._validate_features(msg.encoder_features)
            if error is not None:
                return error
        n = len(msg.prompt_token_ids)
        if n == 0:
            return "the prompt is empty"
        max_len = self.info.max_model_len
        # A generation prompt must leave room for one new token; a pooled one need not.
        if n > max_len or (n == max_len and msg.pooling_params is None):
            return f"the prompt has {n} tokens; the maximum context length is {max_len}"
        vocab = self.info.vocab_size
        if any(t < 0 or t >= vocab for t in msg.prompt_token_ids):
            return f"prompt token ids must be in [0, {vocab})"
        try:
            if msg.pooling_params is not None:
                msg.pooling_params.validate()
            else:
                msg.sampling_params.validate(vocab)
        except ValueError as e:
            return str(e)
        return self._validate_kv_transfer(msg)

    def _validate_kv_transfer(self, msg: AddRequest) -> str | None:
        """kv_transfer_params must suit this engine's connector and role."""
        params = msg.kv_transfer_params
        if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            return None  # nothing asked of a connector
        peer = self.peer
        if msg.pooling_params is not None or msg.encoder_features is not None:
            return "kv_transfer_params apply to generation requests only"
        if params.get("do_remote_decode"):
            if peer is None or not peer.config.is_producer:
                return (
                    "kv_transfer_params.do_remote_decode needs an engine started with "
                    '--kv-transfer-config {"kv_connector": "PeerConnector", "kv_role": '
                    '"kv_producer"} (or "kv_both")'
                )
            return None
        if peer is None or not peer.config.is_consumer:
            return (
                "kv_transfer_params.do_remote_prefill needs an engine started with "
                '--kv-transfer-config {"kv_connector": "PeerConnector", "kv_role": '
                '"kv_consumer"} (or "kv_both")'
            )
        try:
            remote_prefill_params(params)
        except ValueError as e:
            return str(e)
        tp_size = params.get("tp_size", peer.world_size)
        if tp_size != peer.world_size:
            return (
                f"the producer runs {tp_size} ranks and this engine {peer.world_size}: "
                "KV moves rank to rank, so their tensor x pipeline sizes must match"
            )
        return None

    def _validate_features(self, features: bytes) -> str | None:
        """A transcription request's log-mel window must have the model's shape."""
        whisper = self.model_config.whisper
        if whisper is None:
            return "encoder_features are only accepted by an encoder-decoder model"
        shape = (whisper.num_mel_bins, whisper.num_input_frames)
        if len(features) != 4 * shape[0] * shape[1]:
            return (
                f"encoder_features must be float32 log-mel features of shape {list(shape)} "
                f"({4 * shape[0] * shape[1]} bytes); got {len(features)} bytes"
            )
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, "abort")

    def abort_client(self, client_id: str) -> int:
        """Abort every request of one frontend; returns how many."""
        ids = [r.request_id for r in self.scheduler.requests.values() if r.client_id == client_id]
        self.scheduler.finish_requests(ids, "abort")
        return len(ids)

    def _start_host_tier(self, prefix_caching: bool) -> HostTier | None:
        """The host-memory tier of --kv-transfer-config's OffloadingConnector."""
        cpu_bytes = offloading_bytes(self.config.kv_transfer_config)
        if cpu_bytes is None:
            return None
        if not prefix_caching:
            raise ValueError(
                "the OffloadingConnector keeps prefix-cache blocks: enable prefix caching"
            )
        per_block = max(self.executor.collective_rpc("kv_block_bytes"))
        slots = cpu_bytes // per_block
        if slots < 1:
            raise ValueError(f"cpu_bytes {cpu_bytes} holds no KV block ({per_block} bytes each)")
        disk = offloading_disk(self.config.kv_transfer_config)
        disk_dir, disk_slots = (disk[0], disk[1] // per_block) if disk else (None, 0)
        if disk and disk_slots < 1:
            raise ValueError(f"disk_bytes {disk[1]} holds no KV block ({per_block} bytes each)")
        self.executor.collective_rpc("allocate_host_kv", (slots, disk_slots, disk_dir))
        logger.info(
            "host KV tier: %d blocks in memory (%.0f MiB)%s",
            slots,
            slots * per_block / 2**20,
            f", {disk_slots} in {disk_dir} ({disk_slots * per_block / 2**20:.0f} MiB)"
            if disk_slots
            else "",
        )
        return HostTier(slots + disk_slots)

    def _start_peer(self) -> PeerConnector | None:
        """The PeerConnector of --kv-transfer-config (None: another or none)."""
        config = parse_kv_transfer_config(self.config.kv_transfer_config)
        if config is None or config.kv_connector != "PeerConnector":
            return None
        if self.model_config.is_encoder or self.model_config.whisper is not None:
            raise ValueError("the PeerConnector moves decoder KV: a generation model only")
        world = self.config.tensor_parallel_size * self.config.pipeline_parallel_size
        endpoints: list[str] = []
        if config.is_producer:
            endpoints = self.executor.collective_rpc(
                "start_kv_server",
                (
                    config.kv_ip,
                    config.kv_port + 1 if config.kv_port else 0,
                    advertised_host(config),
                    config.extra.get("curve_keys"),
                ),
            )
        peer = PeerConnector(config, self.engine_id, self.config.block_size, world, endpoints)
        logger.info(
            "KV connector PeerConnector, %s%s",
            config.kv_role,
            f", side channel {peer.advertise_host}:{peer.side_port}" if config.is_producer else "",
        )
        return peer

    def release_kv_holds(self) -> None:
        """Free the blocks held for consumers that are done with them (or that
        timed out); the server also calls this while idle."""
        if self.peer is not None:
            for key in self.peer.take_released():
                self.scheduler.block_manager.release(key)

    def _kv_transfers(self) -> None:
        """Release holds; pull the KV of remote-prefill requests about to be scheduled."""
        self.release_kv_holds()
        scheduler = self.scheduler
        pending = [r for r in scheduler.waiting if r.kv_pull_pending and r.is_ready and not r.held]
        if not pending:
            return
        # Pull only what the next steps can run: pulled requests hold blocks.
        held = scheduler.block_manager.req_blocks
        pulled = sum(1 for r in scheduler.waiting if r.request_id in held)
        room = self.config.max_num_seqs - len(scheduler.running) - pulled
        for request in pending[: max(room, 0)]:
            if not self._pull_kv(request):
                break  # no free blocks now

    def _pull_kv(self, request: Request) -> bool:
        """Bring a remote-prefill request's KV from its producer; on failure it is
        computed here (visibly). False when the blocks cannot be had yet."""
        peer = self.peer
        assert peer is not None
        params = request.kv_transfer_params
        assert params is not None
        manager = self.scheduler.block_manager
        started = time.monotonic()
        if request.sampling_params.prompt_logprobs is not None:
            self._recompute(request, "prompt logprobs need every prompt position computed here")
            return True
        computed, num_hit = manager.get_computed_blocks(request)
        n = request.num_prompt_tokens
        if not manager.allocate_slots(request, n - num_hit, computed):
            return False
        request.kv_pull_pending = False
        bs = self.config.block_size
        first, last = num_hit // bs, cdiv(n - 1, bs)
        moved = 0
        try:
            ask = {"remote_request_id": params["remote_request_id"]}
            digest = prompt_digest(request.prompt_token_ids)
            reply = peer.call(params, {**ask, "op": "take", "digest": digest, "block_size": bs})
            remote, endpoints = reply["block_ids"], reply["endpoints"]
            if len(endpoints) != peer.world_size:
                raise KVTransferError(
                    f"the producer runs {len(endpoints)} ranks and this engine {peer.world_size}"
                )
            if len(remote) < last:
                raise KVTransferError("the producer holds fewer blocks than the prompt needs")
            if first < last:
                local = manager.get_block_ids(request.request_id)[first:last]
                moved = sum(
                    self.executor.collective_rpc(
                        "pull_kv",
                        (endpoints, remote[first:last], local, peer.pull_timeout_s, peer.curve_dir),
                    )
                )
            try:
                peer.call(params, {**ask, "op": "done"})
            except KVTransferError:
                pass  # the producer frees its blocks at its timeout
        except (KVTransferError, RuntimeError, ValueError, TimeoutError) as e:
            manager.uncache(request.request_id, first)
            manager.free(request)
            self._recompute(request, str(e))
            return True
        seconds = time.monotonic() - started
        num_pulled = max(n - 1 - num_hit, 0)
        request.num_computed_tokens = n - 1
        request.num_cached_tokens = num_hit
        stats = peer.stats
        stats.transfers += 1
        stats.transfer_tokens += num_pulled
        stats.transfer_bytes += moved
        stats.transfer_seconds += seconds
        request.kv_transfer_out = {
            "kv_transfer": "transferred",
            "transferred_tokens": num_pulled,
            "cached_tokens": num_hit,
            "transfer_bytes": moved,
            "transfer_ms": round(seconds * 1000, 3),
            "remote_engine_id": params.get("remote_engine_id"),
        }
        return True

    def _recompute(self, request: Request, reason: str) -> None:
        """A remote-prefill request computed here after all; its answer says why."""
        peer = self.peer
        assert peer is not None
        request.kv_pull_pending = False
        request.num_computed_tokens = 0
        peer.stats.recomputed += 1
        request.kv_transfer_out = {"kv_transfer": "recomputed", "reason": reason}
        logger.warning("request %s: KV computed here, not pulled: %s", request.request_id, reason)

    @property
    def lockstep(self) -> bool:
        """Whether this engine steps together with the other data-parallel engines
        that hold the rest of the experts (worker/expert_parallel.py)."""
        return self.config.expert_parallel_engines

    def any_engine_busy(self) -> bool:
        """Lockstep: whether this engine or any of the others has work this step
        (a collective: every engine calls it once per loop)."""
        return bool(self.executor.collective_rpc("ep_any_work", (self.has_work(),))[0])

    def has_work(self) -> bool:
        paused = self._has_paused_work()
        if paused is not None:
            return paused
        return self.scheduler.has_work() or bool(self._in_flight)

    # ------------------------------------------------------------------- step

    def step(self) -> list[tuple[Request, RequestDelta]]:
        """schedule → execute → update.

        With pipeline stages, plans are submitted until as many are in flight
        as there are stages (or nothing more can be scheduled), then the
        oldest one's result is taken: one update per call either way.
        """
        failed = self._paused_outputs() + self._reap_grammars() + self._expire_queued()
        if self.peer is not None:
            self._kv_transfers()
        while len(self._in_flight) < self.scheduler.pipeline_depth:
            plan = self.scheduler.schedule()
            if plan.is_empty and not plan.finished_request_ids:
                break
            plan.grammar_bitmask = self._grammar_bitmask(plan)
            self.executor.submit(plan)
            self._in_flight.append(plan)
        if not self._in_flight:
            if self.lockstep:  # the other engines' MoE layers need this one anyway
                self.executor.collective_rpc("execute_idle")
            if not failed and self._compiling:
                # Only grammars in flight: wait for one rather than spin.
                wait([r.grammar for r in self._compiling.values() if r.grammar], timeout=0.02)
            return failed
        plan = self._in_flight.popleft()
        result = self.executor.collect()
        ended = self._advance_grammars(plan, result)
        deltas = self.scheduler.update(plan, result, ended)
        self._stamp_versions(deltas)
        return failed + deltas

    def _grammar_bitmask(self, plan: SchedulePlan) -> GrammarBitmask | None:
        """The allowed next tokens of the constrained requests that sample in this step."""
        rows = []
        requests = self.scheduler.requests
        for request_id, n in plan.num_scheduled_tokens.items():
            request = requests[request_id]
            if request.grammar is None or request.is_pooling:
                continue
            if request.num_computed_tokens + n < request.num_tokens:
                continue  # a prompt chunk short of the end: nothing is sampled
            if request.matcher is None:
                request.matcher = new_matcher(request.grammar.result(), request.output_token_ids)
            rows.append((request_id, request.matcher))
        if not rows:
            return None
        return fill_grammar_bitmask(rows, self.model_config.vocab_size)

    def _advance_grammars(self, plan: SchedulePlan, result: StepResult) -> set[str]:
        """Feed the sampled tokens to their matchers; the requests whose grammar ended."""
        ended: set[str] = set()
        if plan.grammar_bitmask is None:
            return ended
        for request_id in plan.grammar_bitmask.request_ids:
            token_id = result.sampled_token_ids.get(request_id)
            request = self.scheduler.requests.get(request_id)
            if token_id is None or request is None or request.matcher is None:
                continue
            if advance_matcher(request.matcher, token_id):
                ended.add(request_id)
        return ended

    def _reap_grammars(self) -> list[tuple[Request, RequestDelta]]:
        """Forget compiled grammars' requests; fail those whose grammar did not compile."""
        failed: list[tuple[Request, RequestDelta]] = []
        for request_id, request in list(self._compiling.items()):
            grammar = request.grammar
            if request.is_finished or grammar is None:
                del self._compiling[request_id]
                continue
            if not grammar.done():
                # The manager fails the Future at --grammar-compile-timeout (killing
                # the compile), or at once when dequeued past its deadline.
                continue
            error = grammar.exception()
            del self._compiling[request_id]
            if error is None:
                continue
            self.scheduler.finish_requests([request_id], "error")
            failed.append(
                (request, RequestDelta(request_id, [], finish_reason="error", error=str(error)))
            )
        return failed

    def _expire_queued(self) -> list[tuple[Request, RequestDelta]]:
        """Fail requests that waited longer than --max-queue-wait for their first schedule."""
        limit = self.config.max_queue_wait_s
        if limit is None or not self.scheduler.waiting:
            return []
        now = time.monotonic()
        expired = [
            r
            for r in self.scheduler.waiting
            if r.num_cached_tokens < 0 and r.num_preemptions == 0 and now - r.queued_at > limit
        ]
        if not expired:
            return []
        self.scheduler.finish_requests([r.request_id for r in expired], "error")
        message = f"the request waited more than {limit:g} s to be scheduled; retry later"
        return [
            (r, RequestDelta(r.request_id, [], "error", error=message, error_kind="queue_timeout"))
            for r in expired
        ]

    def shutdown(self) -> None:
        """Stop the grammar compile processes and the workers."""
        self.structured_output.shutdown()
        self.executor.shutdown()
        if self.peer is not None:
            self.peer.close()

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.is_sleeping = bool(self._asleep)
        return stats
