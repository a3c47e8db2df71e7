"""Tensor and pipeline parallelism: a rank's place in its groups and the
collectives it runs.

vLLM's layout: q/k/v and gate|up are split by output (column-parallel: each
rank its heads, its share of the MLP), o and down by input (row-parallel:
each rank a partial sum, added up by an all-reduce), the embedding and the
LM head by vocabulary. KV heads are split like the query heads, or
replicated when there are fewer of them than ranks. Collectives go over
torch.distributed (gloo on the CPU, NCCL on CUDA), set up by the worker
process (worker/proc.py) with a time limit.

Pipeline parallelism splits the layers into consecutive stages (vLLM's rank
layout: rank = stage * tensor_parallel_size + tensor-parallel rank). The
first stage embeds the tokens, the last holds the final norm and the LM head
and samples; between stages each rank sends the residual stream of its
tokens to the rank of the same tensor-parallel index in the next stage with
torch.distributed send/recv. Each stage's ranks form their own
tensor-parallel group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.engine_core.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's index in its tensor-parallel group and the group's size.

    `shm`: the group's shared-memory all-reduce (ranks on one host's CPUs,
    shm_allreduce.py), used for what fits it; gloo or NCCL do the rest.
    """

    rank: int = 0
    size: int = 1
    shm: Any = field(default=None, compare=False)
    # The torch.distributed group of these ranks (None: the whole world).
    group: Any = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group, in place (x itself without a group)."""
        if self.size > 1 and (self.shm is None or not self.shm.all_reduce(x)):
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        if self.shm is not None:
            gathered = self.shm.all_gather_last(x)
            if gathered is not None:
                return gathered
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, n: int) -> slice:
        """This rank's even share of n rows (n divides by the group's size)."""
        share = n // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def kv_heads(self, num_kv_heads: int) -> slice:
        """This rank's KV heads: an even share, or the one its query heads read
        when there are fewer KV heads than ranks (replicated, as vLLM does)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return slice(head, head + 1)


@dataclass(frozen=True)
class PipelineStage:
    """This rank's pipeline stage: which of the model's layers it holds, and
    the ranks it receives from and sends to (same tensor-parallel index)."""

    index: int = 0
    size: int = 1
    layers: range = range(0)
    prev_rank: int | None = None
    next_rank: int | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The previous stage's tensor of this shape."""
        import torch.distributed as dist

        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=self.prev_rank)
        return x

    def send(self, x: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(x.contiguous(), dst=self.next_rank)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The layers of one stage: an even split, earlier stages taking the remainder."""
    share, extra = divmod(num_layers, num_stages)
    start = stage * share + min(stage, extra)
    return range(start, start + share + (stage < extra))


def pipeline_stage(num_layers: int, tp_size: int, pp_size: int, rank: int) -> PipelineStage:
    """The stage of a rank in vLLM's layout (rank = stage * tp_size + tp rank)."""
    index = rank // tp_size
    return PipelineStage(
        index=index,
        size=pp_size,
        layers=stage_layers(num_layers, pp_size, index),
        prev_rank=rank - tp_size if index > 0 else None,
        next_rank=rank + tp_size if index < pp_size - 1 else None,
    )


def tensor_parallel_groups(tp_size: int, pp_size: int, rank: int) -> Any:
    """This rank's tensor-parallel process group (None: the whole world is one).
    Collective: every rank creates every stage's group, in the same order."""
    if pp_size == 1 or tp_size == 1:
        return None
    import torch.distributed as dist

    mine = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def check_pipeline_parallel(model_config: ModelConfig, size: int) -> None:
    """ValueError unless the model's layers can be split into `size` stages."""
    if size == 1:
        return
    if model_config.is_encoder:
        raise ValueError("encoder (pooling) models run at --pipeline-parallel-size 1 only")
    if model_config.whisper is not None:
        raise ValueError("Whisper models run at --pipeline-parallel-size 1 only")
    if size > model_config.num_layers:
        raise ValueError(
            f"the model's {model_config.num_layers} layers cannot be split into "
            f"--pipeline-parallel-size {size} stages"
        )


def check_tensor_parallel(
    model_config: ModelConfig, size: int, expert_parallel: bool = False
) -> None:
    """ValueError unless the model can be sharded over `size` ranks."""
    mc = model_config
    if expert_parallel and mc.moe is None:
        raise ValueError("--enable-expert-parallel needs a mixture-of-experts model")
    if size == 1:
        return
    if mc.is_encoder:
        raise ValueError("encoder (pooling) models run at --tensor-parallel-size 1 only")
    if mc.whisper is not None:
        raise ValueError("Whisper models run at --tensor-parallel-size 1 only")
    if mc.qk_norm_whole:
        raise ValueError(
            "OLMoE normalizes q and k over all heads: it runs at --tensor-parallel-size 1 only"
        )
    if mc.num_heads % size:
        raise ValueError(
            f"the model's {mc.num_heads} attention heads do not divide by "
            f"--tensor-parallel-size {size}"
        )
    if mc.num_kv_heads % size and size % mc.num_kv_heads:
        raise ValueError(
            f"the model's {mc.num_kv_heads} KV heads and --tensor-parallel-size {size}: "
            "one must divide the other"
        )
    if expert_parallel and mc.moe is not None and mc.moe.num_experts % size:
        raise ValueError(
            f"the model's {mc.moe.num_experts} experts do not divide by "
            f"--tensor-parallel-size {size} (--enable-expert-parallel)"
        )
    if not expert_parallel and mc.moe is not None and mc.moe.intermediate_size % size:
        raise ValueError(
            f"the model's expert MLP size {mc.moe.intermediate_size} does not divide by "
            f"--tensor-parallel-size {size}"
        )
    if mc.intermediate_size % size:
        raise ValueError(
            f"the model's MLP size {mc.intermediate_size} does not divide by "
            f"--tensor-parallel-size {size}"
        )


def check_expert_parallel_engines(model_config: ModelConfig, config: Any) -> None:
    """ValueError unless the experts can be split over the data-parallel engines
    (`config` an EngineConfig with expert_parallel_engines set)."""
    size = config.data_parallel_size
    moe = model_config.moe
    if moe is None:
        raise ValueError("--enable-expert-parallel needs a mixture-of-experts model")
    if config.executor_backend != "uni":
        raise ValueError(
            "expert parallelism across data-parallel engines runs each engine at one rank "
            "(--tensor-parallel-size 1, --pipeline-parallel-size 1, the uni executor) for now"
        )
    if moe.num_experts % size:
        raise ValueError(
            f"the model's {moe.num_experts} experts do not divide by "
            f"--data-parallel-size {size} (--enable-expert-parallel)"
        )


def engine_experts(model_config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The model config of data-parallel engine `rank` of `size`: its share of the experts."""
    moe = model_config.moe
    assert moe is not None
    share = moe.num_experts // size
    return dataclasses.replace(
        model_config, moe=dataclasses.replace(moe, local_experts=(rank * share, (rank + 1) * share))
    )


def rank_config(
    model_config: ModelConfig, tp: TensorParallel, expert_parallel: bool = False
) -> ModelConfig:
    """The model config as one rank sees it: its heads and its share of the MLP
    (with expert parallelism, its experts whole)."""
    if tp.size == 1:
        return model_config
    mc = model_config
    moe = mc.moe
    if moe is not None and expert_parallel:
        share = moe.num_experts // tp.size
        moe = dataclasses.replace(moe, local_experts=(tp.rank * share, (tp.rank + 1) * share))
    elif moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // tp.size)
    return dataclasses.replace(
        mc,
        num_heads=mc.num_heads // tp.size,
        num_kv_heads=max(mc.num_kv_heads // tp.size, 1),
        intermediate_size=mc.intermediate_size // tp.size,
        moe=moe,
    )


def shared_memory_all_reduce(tp: TensorParallel, device: torch.device, tag: str) -> Any:
    """The shared-memory all-reduce for a CPU group on one x86 host, else None
    (PAGODA_CPU_ALLREDUCE=gloo keeps gloo for everything). Collective: every
    rank of the group calls it with the same tag."""
    if tp.size == 1 or device.type != "cpu":
        return None
    if os.environ.get("PAGODA_CPU_ALLREDUCE", "shm") == "gloo":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return None  # its flags rely on x86's store order
    import torch.distributed as dist

    from pagoda.engine_core.worker.shm_allreduce import SharedMemoryAllReduce, bytes_needed

    # /dev/shm may be small (a container's default is 64 MiB); touching pages
    # past it would kill the process. Every rank must choose alike: the
    # smallest answer wins.
    try:
        stat = os.statvfs("/dev/shm")
        room = stat.f_bavail * stat.f_frsize >= 2 * bytes_needed(tp.size)
    except OSError:
        room = False
    agreed = torch.tensor([int(room)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.group)
    if not agreed.item():
        logger.warning("too little room in /dev/shm for the shared-memory all-reduce: gloo")
        return None
    return SharedMemoryAllReduce(tp.rank, tp.size, f"pagoda-tp-{tag}")
