"""All-reduce and all-gather through shared memory, for tensor-parallel ranks on
one host's CPUs.

gloo's all-reduce costs about half a millisecond a call whatever the size
(docs/benchmarks.md, "Several ranks on one host"), and a decode step makes
two a layer. Here every rank copies its tensor into its slot of a shared
buffer, publishes the call's number in its own flag, waits until every
rank's flag has reached it, and adds the slots up in rank order, so every
rank computes the same sum bit for bit (and samples the same tokens). Two
buffers alternate, so a rank may write the next call's slot while a slower
rank still reads the previous one: a rank that reached call n has finished
reading call n - 1's data, whose buffer call n + 1 reuses.

x86's stores are seen by other cores in program order, so a slot written
before the flag is complete when the flag is seen. Waiting ranks yield the
CPU (ranks may outnumber cores). The all-gather (the head's vocabulary
slices) shares the buffers and the flags. Tensors larger than a slot go to
gloo.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

_FLAG_STRIDE = 8  # int64s per rank's flag: a cache line each, no false sharing
# A batch of 64 rows of float32 logits over half of a 49,152-token vocabulary fits.
SLOT_BYTES = 8 << 20


def bytes_needed(size: int, slot_bytes: int = SLOT_BYTES) -> int:
    """The shared buffer's size for a group of `size` ranks."""
    return size * _FLAG_STRIDE * 8 + 2 * size * slot_bytes


class SharedMemoryAllReduce:
    """One group's buffers; every rank of the group builds one (collectively)."""

    def __init__(self, rank: int, size: int, name: str, slot_bytes: int = SLOT_BYTES) -> None:
        import torch.distributed as dist

        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        header = size * _FLAG_STRIDE * 8
        total = bytes_needed(size, slot_bytes)
        if rank == 0:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=total)
            np.ndarray((header,), dtype=np.uint8, buffer=self._shm.buf)[:] = 0
        dist.barrier()
        if rank != 0:
            self._shm = shared_memory.SharedMemory(name=name)
            # Attaching registered it with this process's resource tracker,
            # which would warn of a leak (and unlink it again) at exit; rank 0
            # owns it and unlinks it below.
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        dist.barrier()
        if rank == 0:
            self._shm.unlink()  # the mappings stay; nothing is left in /dev/shm
        self._flags = np.ndarray((size, _FLAG_STRIDE), dtype=np.int64, buffer=self._shm.buf)
        data = torch.frombuffer(self._shm.buf, dtype=torch.uint8, offset=header)
        self._buffers = data.view(2, size, slot_bytes)
        self._calls = 0
        # Called now and then while waiting: False when a rank is gone for good
        # (the wait then fails instead of spinning forever).
        self.peers_alive: Callable[[], bool] | None = None

    def _exchange(self, x: torch.Tensor) -> torch.Tensor | None:
        """Publish x in this rank's slot and wait for every rank's: the slots,
        [size, nbytes] bytes; None (nothing done) when x does not fit."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes or x.device.type != "cpu":
            return None
        self._calls += 1
        call = self._calls
        slots = self._buffers[call & 1]
        slots[self.rank, :nbytes].view(x.dtype).copy_(x.reshape(-1))
        self._publish(call)
        return slots[:, :nbytes]

    def _publish(self, call: int) -> None:
        """Mark this rank's slot of `call` written and wait for every rank's."""
        self._flags[self.rank, 0] = call
        flags = self._flags[:, 0]
        spins = 0
        while int(flags.min()) < call:
            os.sched_yield()
            spins += 1
            if spins & 0xFFF == 0 and self.peers_alive is not None and not self.peers_alive():
                raise RuntimeError("a rank of the shared-memory group is gone")

    def exchange_rows(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x ([rows, ...], the same trailing shape and dtype; the
        rows may differ), in rank order, as views of the shared buffer valid
        until this rank's next call but one; None when x does not fit."""
        header = 64  # the rank's row count, then the rows (cache-line aligned)
        nbytes = x.numel() * x.element_size()
        if header + nbytes > self.slot_bytes or x.device.type != "cpu":
            return None
        self._calls += 1
        call = self._calls
        slots = self._buffers[call & 1]
        mine = slots[self.rank]
        mine[:8].view(torch.int64)[0] = x.shape[0]
        mine[header : header + nbytes].view(x.dtype).copy_(x.reshape(-1))
        self._publish(call)
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        out = []
        for r in range(self.size):
            rows = int(slots[r, :8].view(torch.int64)[0])
            data = slots[r, header : header + rows * row_bytes].view(x.dtype)
            out.append(data.view(rows, *x.shape[1:]))
        return out

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        """The ranks' x side by side along the last dimension; None when x does not fit."""
        slots = self._exchange(x)
        if slots is None:
            return None
        parts = [slots[r].view(x.dtype).view(x.shape) for r in range(self.size)]
        return torch.cat(parts, dim=-1)

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum x over the group in place; False (nothing done) when x does not fit."""
        slots = self._exchange(x)
        if slots is None:
            return False
        flat = x.reshape(-1)
        total = slots[0].view(x.dtype)
        flat.copy_(total)
        for r in range(1, self.size):
            flat.add_(slots[r].view(x.dtype))
        if not x.is_contiguous():
            x.copy_(flat.view(x.shape))
        return True

    def close(self) -> None:
        self._buffers = None  # type: ignore[assignment]
        self._flags = None  # type: ignore[assignment]
        self._shm.close()
