"""Worker: one rank's device, model, KV cache and model runner.

An executor owns one Worker per rank (one today, in the engine-core
process) and reaches it only through `execute_model(plan)` and the named
control calls of `collective_rpc`: the public methods below. Their
arguments and results are plain values, so a worker in another process
takes the same calls over a channel.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import msgspec
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.plan import SchedulePlan, StepResult
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.worker.encoder_runner import EncoderRunner
from pagoda.engine_core.worker.expert_parallel import (
    ExpertExchange,
    attach,
    exchange_kind,
    idle_pass,
    join_world,
    shared_memory_exchange,
)
from pagoda.engine_core.worker.host_tier import TieredSlots, disk_slots
from pagoda.engine_core.worker.kv_peer import KVPuller, KVServer
from pagoda.engine_core.worker.model_runner import ModelRunner, resolve_device
from pagoda.engine_core.worker.parallel import (
    TensorParallel,
    check_expert_parallel_engines,
    check_pipeline_parallel,
    check_tensor_parallel,
    engine_experts,
    pipeline_stage,
    rank_config,
    shared_memory_all_reduce,
    tensor_parallel_groups,
)
from pagoda.engine_core.worker.whisper_runner import WhisperRunner

logger = logging.getLogger(__name__)

# How long the expert-parallel engines wait for each other (to meet, and in a
# collective) before one gives up: a rank that dies closes its connections and
# fails the others at once; this bounds a rank that hangs.
EP_WORLD_TIMEOUT_S = 120.0


class WorkerInfo(msgspec.Struct, kw_only=True):
    """What a worker reports once loaded (logged by the engine core)."""

    rank: int
    device: str  # "cpu", "cuda:0" ...
    dtype: str  # "bfloat16" ...
    pooler: str  # the default pooler (used by the embed task)
    # How tensor-parallel partial sums are added: "shm", "gloo", "nccl", "" (one rank).
    all_reduce: str = ""
    # Its pipeline stage and the model layers it holds [first, last + 1).
    stage: int = 0
    layers: tuple[int, int] = (0, 0)


def device_type(config: EngineConfig) -> str:
    """Where the workers of this config run: "cpu" or "cuda" ("auto": CUDA if torch sees one)."""
    return resolve_device(config.device).type


class Worker:
    """One rank: builds its runner (a decoder's ModelRunner, an encoder's
    EncoderRunner, or Whisper's WhisperRunner)."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        rank: int = 0,
        shm_tag: str | None = None,
    ) -> None:
        """`shm_tag`: where all ranks share one host, a name unique to the engine
        for the shared-memory all-reduce (None: torch.distributed alone)."""
        self.config = config
        self.rank = rank
        size, stages = config.tensor_parallel_size, config.pipeline_parallel_size
        check_tensor_parallel(model_config, size, config.enable_expert_parallel)
        check_pipeline_parallel(model_config, stages)
        self.stage = pipeline_stage(model_config.num_layers, size, stages, rank)
        group = tensor_parallel_groups(size, stages, rank)
        self.tp = TensorParallel(rank % size, size, group=group)
        if size > 1 and shm_tag is not None:
            shm = shared_memory_all_reduce(
                self.tp, resolve_device(config.device), f"{shm_tag}-s{self.stage.index}"
            )
            self.tp = TensorParallel(self.tp.rank, size, shm, group)
        # Expert parallelism across data-parallel engines (worker/expert_parallel.py).
        self.ep: ExpertExchange | None = None
        if config.expert_parallel_engines:
            check_expert_parallel_engines(model_config, config)
            dp_rank, dp_size = config.data_parallel_rank, config.data_parallel_size
            join_world(
                dp_rank,
                dp_size,
                config.data_parallel_address,
                config.data_parallel_rpc_port,
                EP_WORLD_TIMEOUT_S,
            )
            kind, shm = exchange_kind(), None
            if kind == "shm":
                # The most tokens a step of any engine runs (drafts included).
                rows = (config.max_num_batched_tokens or 2048) + config.max_num_seqs
                shm = shared_memory_exchange(
                    dp_rank,
                    dp_size,
                    str(config.data_parallel_rpc_port),
                    rows,
                    model_config.hidden_size,
                    resolve_device(config.device),
                )
                kind = "shm" if shm is not None else "allgather"
            self.ep = ExpertExchange(dp_rank, dp_size, kind, shm=shm)
            model_config = engine_experts(model_config, dp_rank, dp_size)
            assert model_config.moe is not None
            logger.info(
                "expert parallel: engine %d of %d holds experts %s, exchange %s",
                dp_rank,
                dp_size,
                model_config.moe.local_experts,
                kind,
            )
            # The exchange's sizes change every step: no CUDA graphs.
            config = dataclasses.replace(config, enforce_eager=True)
        self.runner: ModelRunner | EncoderRunner
        if model_config.is_encoder:
            self.runner = EncoderRunner(config, model_config)
        elif model_config.whisper is not None:
            self.runner = WhisperRunner(config, model_config)
        else:
            self.runner = ModelRunner(
                config,
                rank_config(model_config, self.tp, config.enable_expert_parallel),
                self.tp,
                self.stage,
            )
        if self.ep is not None:
            attach(self._decoder("experts across engines").model.layers, self.ep)
        self._profiler: torch.profiler.profile | None = None
        # The PeerConnector (worker/kv_peer.py): this rank's block server (a
        # producer) and its pulls from producers' ranks (a consumer).
        self._kv_server: KVServer | None = None
        self._kv_puller: KVPuller | None = None

    # ----------------------------------------------------------------- step

    def initialize_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the paged KV cache (from the memory budget, or as many blocks
        as given); returns its number of blocks."""
        if isinstance(self.runner, EncoderRunner):
            return self.runner.allocate_kv_cache()
        return self.runner.allocate_kv_cache(num_blocks)

    def execute_model(self, plan: SchedulePlan) -> StepResult:
        result = self.runner.execute(plan)
        if self.ep is not None and plan.is_empty:
            self.execute_idle()  # the other engines' MoE layers still need this one
        return result

    def ep_any_work(self, mine: bool) -> bool:
        """Whether any of the expert-parallel engines has work this step."""
        assert self.ep is not None
        return self.ep.any_work(mine)

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """A step with nothing to run here: join each MoE layer's exchange."""
        assert self.ep is not None
        idle_pass(self._decoder("experts across engines").model.layers)

    # -------------------------------------------------------- control calls

    def describe(self) -> WorkerInfo:
        runner = self.runner
        return WorkerInfo(
            rank=self.rank,
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            pooler=str(runner.pooler),
            all_reduce=self._all_reduce_kind(),
            stage=self.stage.index,
            layers=(self.stage.layers.start, self.stage.layers.stop),
        )

    def _all_reduce_kind(self) -> str:
        if self.tp.size == 1:
            return ""
        if self.tp.shm is not None:
            return "shm"
        import torch.distributed as dist

        return str(dist.get_backend())

    def check_health(self) -> bool:
        return True

    def sleep(self, level: int, spill_dir: str | None) -> None:
        """Free the KV cache; park the weights (level 1) or drop them (level 2)."""
        runner = self.runner
        if isinstance(runner, EncoderRunner):
            raise RuntimeError("sleep mode is not supported for encoder (pooling) models")
        if isinstance(runner, WhisperRunner):
            raise RuntimeError("sleep mode is not supported for Whisper models")
        runner.release_kv_cache()
        runner.offload_weights(keep_copy=level == 1, spill_dir=spill_dir)

    def wake_up(self, weights: bool, kv_cache: bool, num_blocks: int) -> None:
        runner = self.runner
        if isinstance(runner, EncoderRunner):
            return  # never asleep
        if weights:
            runner.reload_weights()
        if kv_cache:
            runner.allocate_kv_cache(num_blocks)

    def register_lora(self, name: str, path: str) -> int:
        """Read an adapter into host memory; returns its rank."""
        return self._decoder("LoRA adapters").register_lora(name, path)

    def unregister_lora(self, name: str) -> None:
        self._decoder("LoRA adapters").unregister_lora(name)

    def load_lora(self, slot: int, name: str) -> None:
        self._decoder("LoRA adapters").load_lora(slot, name)

    def init_weight_transfer(self, backend: str, init_info: dict[str, Any]) -> None:
        """Join the trainer's torch.distributed group for weight updates."""
        self._decoder("weight updates").init_weight_transfer(backend, init_info, self.rank)

    def receive_weights(self, update_info: dict[str, Any]) -> int:
        """Receive the trainer's broadcast tensors and load them; returns how many."""
        return self._decoder("weight updates").receive_weights(update_info)

    def load_weights_from_file(self, path: str, names: list[str] | None) -> int:
        return self._decoder("weight updates").load_weights_from_file(path, names)

    def weight_checksums(self) -> dict[str, str]:
        return self._decoder("weight updates").weight_checksums()

    def kv_block_bytes(self) -> int:
        """Bytes one KV block takes on this rank (its layers, its KV heads)."""
        return self._decoder("the host KV tier").kv_bytes_per_block()

    def allocate_host_kv(
        self, num_slots: int, num_disk_slots: int = 0, disk_dir: str | None = None
    ) -> None:
        """The host tier's blocks (--kv-transfer-config OffloadingConnector):
        `num_slots` in memory, then `num_disk_slots` in a file under `disk_dir`
        (worker/host_tier.py)."""
        runner = self._decoder("the host KV tier")
        runner.allocate_host_kv(num_slots)
        if not num_disk_slots:
            return
        assert disk_dir is not None
        layouts = [(tuple(t.shape[1:]), t.dtype) for k, v in runner.kv_caches for t in (k, v)]
        files = disk_slots(disk_dir, num_disk_slots, layouts, self.rank)
        tiered: Any = [
            (TieredSlots(hk, files[2 * i]), TieredSlots(hv, files[2 * i + 1]))
            for i, (hk, hv) in enumerate(runner.host_kv)
        ]
        runner.host_kv = tiered

    def start_kv_server(
        self, host: str, port: int, advertise_host: str, curve_dir: str | None
    ) -> str:
        """Serve this rank's KV blocks to consumers (port 0: any free port, else
        `port + rank`); returns the endpoint they connect to."""
        self._decoder("KV transfers")
        if self._kv_server is None:
            self._kv_server = KVServer(
                lambda: self._decoder("KV transfers").kv_caches,
                host,
                port + self.rank if port else 0,
                advertise_host,
                curve_dir,
            )
        return self._kv_server.endpoint

    def pull_kv(
        self,
        endpoints: list[str],
        remote_ids: list[int],
        local_ids: list[int],
        timeout_s: float,
        curve_dir: str | None,
    ) -> int:
        """Copy a producer's blocks (from the same rank of it) into local blocks;
        returns the bytes moved."""
        runner = self._decoder("KV transfers")
        if self._kv_puller is None:
            self._kv_puller = KVPuller(curve_dir)
        return self._kv_puller.pull(
            runner.kv_caches, endpoints[self.rank], remote_ids, local_ids, timeout_s
        )

    def start_profile(self) -> None:
        """Start a torch.profiler trace of this rank's steps."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.runner.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def stop_profile(self, directory: str, name: str) -> str:
        """Stop the trace and write it as DIRECTORY/NAME-rankR-TIME.json; returns the path."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            raise ValueError("no profile is running")
        profiler.stop()
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{name}-rank{self.rank}-{int(time.time())}.json")
        profiler.export_chrome_trace(path)
        return path

    def shutdown(self) -> None:
        self._profiler = None
        if self._kv_server is not None:
            self._kv_server.close()
        if self._kv_puller is not None:
            self._kv_puller.close()
        if self.tp.shm is not None:
            self.tp.shm.close()
        if self.ep is not None:
            import torch.distributed as dist

            if self.ep.shm is not None:
                self.ep.shm.close()

            if dist.is_initialized():
                dist.destroy_process_group()

    def _decoder(self, what: str) -> ModelRunner:
        if isinstance(self.runner, EncoderRunner | WhisperRunner):
            raise ValueError(f"{what} are supported on Llama-family decoders only")
        return self.runner
