"""The host KV tier's disk level: slots past the memory ones live in a file.

The OffloadingConnector's `disk_dir` and `disk_bytes` extend the tier
(core/kv_offload.py) with slots in a file there: one file per rank, mapped
into memory (`torch.from_file`, shared) and unlinked at once, so nothing is
left behind however the engine ends. The kernel writes the pages out as it
needs the memory and reads them back on a prefix hit. Slot numbers run on
from the memory slots; `TieredSlots` is one layer's key (or value) slots
over both, indexed like a tensor with a tensor of slot numbers, so the
runner's copies (`_copy_host_kv`) need not know where a slot lives.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch


class TieredSlots:
    """A layer's host slots: the first `split` in memory, the rest in the file."""

    def __init__(self, memory: torch.Tensor, disk: torch.Tensor) -> None:
        self.memory = memory
        self.disk = disk
        self.split = memory.shape[0]
        self.device = memory.device
        self.dtype = memory.dtype
        self.shape = (self.split + disk.shape[0], *memory.shape[1:])

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        out = torch.empty((len(slots), *self.shape[1:]), dtype=self.dtype)
        in_memory = slots < self.split
        out[in_memory] = self.memory[slots[in_memory]]
        on_disk = ~in_memory
        out[on_disk] = self.disk[slots[on_disk] - self.split]
        return out

    def __setitem__(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        in_memory = slots < self.split
        self.memory[slots[in_memory]] = values[in_memory]
        on_disk = ~in_memory
        self.disk[slots[on_disk] - self.split] = values[on_disk]


def disk_slots(
    directory: str, num_slots: int, layouts: list[tuple[tuple[int, ...], torch.dtype]], rank: int
) -> list[torch.Tensor]:
    """`num_slots` slots of each layout (shape of one slot, dtype) in one
    mapped file under `directory`, already unlinked."""
    os.makedirs(directory, exist_ok=True)
    dtype = layouts[0][1]
    per_slot = [math.prod(shape) for shape, _ in layouts]
    fd, path = tempfile.mkstemp(prefix=f"pagoda-kv-rank{rank}-", suffix=".bin", dir=directory)
    os.close(fd)
    try:
        flat = torch.from_file(path, shared=True, size=num_slots * sum(per_slot), dtype=dtype)
    finally:
        os.unlink(path)  # the mapping stays; the name goes
    out = []
    offset = 0
    for (shape, _), n in zip(layouts, per_slot, strict=True):
        out.append(flat[offset : offset + num_slots * n].view(num_slots, *shape))
        offset += num_slots * n
    return out
