"""Expert parallelism across data-parallel engine cores.

With `--enable-expert-parallel` and `--data-parallel-size N` (each engine at
one rank), the N engine cores join one torch.distributed world and split every
MoE layer's experts into N contiguous shares. Each engine keeps its own
requests, KV cache and attention; only the MoE layers are shared. In every MoE
layer the engines exchange their tokens so that each token reaches the ranks
that hold its experts, and the outputs come back.

The exchange, chosen by PAGODA_EP_EXCHANGE (scripts/bench_ep_exchange.py
measures them, docs/benchmarks.md):

- "shm" (the default where it can run: engines on one x86 host's CPUs, room
  in /dev/shm; otherwise "allgather"): the all-gather below through shared
  memory (worker/shm_allreduce.py), since gloo costs 0.3-1.7 ms a collective
  on this host's loopback, several times what a small MoE layer computes.
- "allgather": every rank gathers all ranks' tokens (padded to the largest
  count) over torch.distributed, computes its experts' weighted share for all
  of them, and a reduce-scatter hands each rank the sum for its own tokens.
- "alltoall": every rank routes its tokens and sends each (token, expert) pair
  only to the rank holding that expert (all-to-all with per-rank counts); the
  weighted outputs travel back the same way and are added per token.

The collectives need every rank in them, so the engines step in lockstep
(engine_core/server.py): before each step they agree whether any has work,
and an engine with nothing to run takes an idle pass, which joins each MoE
layer's exchange with no tokens of its own (vLLM runs a dummy batch for the
same reason). A rank that dies makes the others' collectives fail within the
world's timeout, and the engine cores stop rather than hang.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from pagoda.engine_core.models.moe import grouped_op, route

if TYPE_CHECKING:
    from pagoda.engine_core.models.moe import MoELayer

logger = logging.getLogger(__name__)

EXCHANGES = ("shm", "allgather", "alltoall")
DEFAULT_EXCHANGE = "shm"


def exchange_kind() -> str:
    kind = os.environ.get("PAGODA_EP_EXCHANGE", DEFAULT_EXCHANGE)
    if kind not in EXCHANGES:
        raise ValueError(f"PAGODA_EP_EXCHANGE must be one of {', '.join(EXCHANGES)}, not {kind!r}")
    return kind


def shared_memory_exchange(
    rank: int, size: int, tag: str, max_rows: int, hidden: int, device: torch.device
) -> Any:
    """The engines' shared-memory buffers (SharedMemoryAllReduce), sized for
    every rank's `max_rows` tokens of `hidden` float32 values, or None where the
    engines are not all on one x86 host's CPUs or /dev/shm lacks the room.
    Collective: every engine calls it, and all choose alike."""
    import platform

    import torch.distributed as dist

    from pagoda.engine_core.worker.shm_allreduce import SharedMemoryAllReduce, bytes_needed

    slot = 64 + size * max_rows * hidden * 4
    slot = -(-slot // 64) * 64
    try:
        stat = os.statvfs("/dev/shm")
        room = stat.f_bavail * stat.f_frsize >= 2 * bytes_needed(size, slot)
    except OSError:
        room = False
    ok = room and device.type == "cpu" and platform.machine() in ("x86_64", "AMD64")
    # One host: every engine sees the same hostname.
    names: list[Any] = [None] * size
    dist.all_gather_object(names, (socket.gethostname(), os.getpid()))
    ok = ok and len({host for host, _ in names}) == 1
    agreed = torch.tensor([int(ok)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if not agreed.item():
        logger.warning("expert parallel: the engines exchange tokens over torch.distributed")
        return None
    shm = SharedMemoryAllReduce(rank, size, f"pagoda-ep-{tag}", slot)
    pids = [pid for _, pid in names]
    shm.peers_alive = lambda: all(_alive(pid) for pid in pids)
    return shm


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie its parent has not reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def join_world(rank: int, size: int, address: str, port: int, timeout_s: float) -> None:
    """Join the engines' torch.distributed world (gloo on the CPU, NCCL on CUDA)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    host = f"[{address}]" if ":" in address else address
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    logger.info("expert parallel: rank %d of %d engines (%s)", rank, size, backend)


@dataclass
class ExpertExchange:
    """This engine's place in the expert-parallel world and its MoE exchange."""

    rank: int
    size: int
    kind: str = DEFAULT_EXCHANGE
    group: Any = None  # None: the whole world
    shm: Any = None  # the shared-memory buffers of kind "shm"

    def any_work(self, mine: bool) -> bool:
        """Whether any engine has work this step (every engine calls it once a step)."""
        import torch.distributed as dist

        flag = torch.tensor([int(mine)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def __call__(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None:
            return self._shared_memory(layer, x)
        if self.kind == "alltoall":
            return self._all_to_all(layer, x)
        return self._all_gather(layer, x)

    def _shared_memory(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
        """The all-gather exchange through shared memory: every engine publishes
        its tokens, computes its experts' share for all of them, publishes that,
        and adds up the shares of its own tokens in rank order."""
        parts = self.shm.exchange_rows(x)
        if parts is None:
            raise RuntimeError(f"{x.shape[0]} tokens do not fit the expert-parallel buffers")
        counts = [len(p) for p in parts]
        if not sum(counts):
            return x
        partial = layer.local_share(torch.cat(parts))  # a copy: the buffer is reused
        shares = self.shm.exchange_rows(partial)
        if shares is None:
            raise RuntimeError(f"{partial.shape[0]} rows do not fit the expert-parallel buffers")
        start = sum(counts[: self.rank])
        mine = slice(start, start + x.shape[0])
        out = shares[0][mine].clone()
        for share in shares[1:]:
            out += share[mine]
        return out

    def _all_gather(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:

        n, hidden = x.shape
        counts = torch.zeros(self.size, dtype=torch.int64)
        _all_gather(counts, torch.tensor([n], dtype=torch.int64), group=self.group)
        per_rank = counts.tolist()
        most = max(per_rank)
        if most == 0:
            return x
        padded = x.new_zeros((most, hidden))
        padded[:n] = x
        gathered = x.new_empty((self.size * most, hidden))
        _all_gather(gathered, padded, group=self.group)
        rows = torch.cat(
            [torch.arange(r * most, r * most + c, device=x.device) for r, c in enumerate(per_rank)]
        )
        partial = x.new_zeros((self.size * most, hidden))
        partial[rows] = layer.local_share(gathered.index_select(0, rows))
        out = x.new_empty((most, hidden))
        _reduce_scatter(out, partial, group=self.group)
        return out[:n]

    def _all_to_all(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        n, hidden = x.shape
        weights, ids = route(x, layer.router, layer.top_k, layer.renormalize)
        share = layer.router.shape[0] // self.size
        pair_ids = ids.reshape(-1)
        order = torch.argsort(pair_ids // share, stable=True)
        pair_ids = pair_ids.index_select(0, order)
        token_of = torch.arange(n, device=x.device).repeat_interleave(layer.top_k)[order]
        send_counts = torch.bincount(pair_ids // share, minlength=self.size).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        # Each pair's row, and its expert and weight (float32: ids are small integers).
        meta = torch.stack([pair_ids.to(torch.float32), weights.reshape(-1)[order]], dim=1)
        their_rows = x.new_empty((sum(recvs), hidden))
        dist.all_to_all_single(
            their_rows, x.index_select(0, token_of), recvs, sends, group=self.group
        )
        their_meta = meta.new_empty((sum(recvs), 2))
        dist.all_to_all_single(their_meta, meta, recvs, sends, group=self.group)
        local = their_meta[:, 0].to(torch.int64) - layer.first_expert
        pairs = torch.arange(local.shape[0], device=x.device)
        outputs = grouped_op(their_rows)(
            their_rows, layer.w13, layer.w2, pairs, local, their_meta[:, 1]
        )
        back = x.new_empty((len(token_of), hidden))
        dist.all_to_all_single(back, outputs, sends, recvs, group=self.group)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, back)
        return out


def _all_gather(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    # all_gather_single is the newer name of all_gather_into_tensor.
    op = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    op(out, x, group=group)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    op = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    op(out, x, group=group)


def attach(layers: Any, exchange: ExpertExchange) -> int:
    """Route the MoE layers of a model's `layers` through the exchange; returns how many."""
    count = 0
    for layer in layers:
        moe = getattr(layer, "moe", None)
        if moe is not None:
            moe.ep = exchange
            count += 1
    return count


def idle_pass(layers: Any) -> None:
    """Join every MoE layer's exchange, in order, with no tokens: what an engine
    with nothing to run does while another engine steps."""
    for layer in layers:
        moe = getattr(layer, "moe", None)
        if moe is not None:
            moe(moe.router.new_empty((0, moe.router.shape[1])))
