"""A host-memory tier for prefix-cache blocks (vLLM's OffloadingConnector).

Imports no torch. When the block manager hands out a free block that still
holds a cached prefix, the tier keeps a copy of it in host memory first (the
worker copies the block into a host slot before the step that overwrites
it); when a later prompt's prefix runs past what the device cache holds, the
blocks the tier has come back into fresh device blocks (copied before the
step that reads them) instead of being computed again. The tier is an LRU
of `num_slots` slots keyed by the blocks' chained prefix hashes, so a hit
is exactly the content the same tokens (and adapter, and salt) produced.

With `disk_dir` and `disk_bytes` the tier has more slots than memory holds:
those past the memory ones live in a file in that directory
(worker/host_tier.py), one LRU over all of them.

The copies travel in the plan (`SchedulePlan.kv_saves`, `kv_loads`) and a
worker runs them before the forward pass, saves first, in plan order: a
slot saved in one plan and loaded in a later one reads what was saved; a
slot about to be loaded in the current plan is never chosen to save into.
"""

from __future__ import annotations

from collections import OrderedDict

from pagoda.engine_core.core.kv_connector import parse_kv_transfer_config


class HostTier:
    """Which prefix blocks the host slots hold, and the copies the next plan carries."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("the host KV tier needs room for at least one block")
        self.num_slots = num_slots
        self.slots: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self.free = list(range(num_slots - 1, -1, -1))
        self.saves: list[tuple[int, int]] = []  # (device block, slot) for the next plan
        self.loads: list[tuple[int, int]] = []  # (slot, device block) for the next plan
        # Blocks about to be loaded: their slots are not given to new saves.
        self.reserved: set[int] = set()
        self.num_saved = 0  # blocks copied out
        self.num_loaded = 0  # blocks brought back (prefix hits from this tier)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.slots

    def save(self, block_id: int, block_hash: int) -> None:
        """Keep a block that is about to be reused (once per content)."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot is being loaded in this plan: this block is not kept
        self.slots[block_hash] = slot
        self.saves.append((block_id, slot))
        self.num_saved += 1

    def load(self, block_hash: int, block_id: int) -> None:
        """Bring a kept block back into `block_id` before the next forward pass."""
        slot = self.slots[block_hash]
        self.slots.move_to_end(block_hash)
        self.loads.append((slot, block_id))
        self.num_loaded += 1

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The saves and loads for the plan being built (and forget them here)."""
        saves, loads = self.saves, self.loads
        self.saves, self.loads = [], []
        return saves, loads

    def clear(self) -> None:
        """Forget every kept block (a weight update makes them stale)."""
        self.slots.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))

    def _take_slot(self) -> int | None:
        if self.free:
            return self.free.pop()
        loading = {slot for slot, _ in self.loads}
        for block_hash, slot in self.slots.items():  # least recently used first
            if slot not in loading and block_hash not in self.reserved:
                del self.slots[block_hash]
                return slot
        return None


def offloading_bytes(kv_transfer_config: str | None) -> int | None:
    """The host tier's size from --kv-transfer-config (None: no OffloadingConnector).

    A config that is not valid (core/kv_connector.py), or an
    OffloadingConnector without a positive `cpu_bytes`, is a clear error at start.
    """
    config = parse_kv_transfer_config(kv_transfer_config)
    if config is None or config.kv_connector != "OffloadingConnector":
        return None
    cpu_bytes = config.extra.get("cpu_bytes")
    if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int) or cpu_bytes <= 0:
        raise ValueError(
            "the OffloadingConnector needs kv_connector_extra_config.cpu_bytes, a positive integer"
        )
    return cpu_bytes


def offloading_disk(kv_transfer_config: str | None) -> tuple[str, int] | None:
    """The tier's disk level (`disk_dir`, `disk_bytes`), or None without one."""
    config = parse_kv_transfer_config(kv_transfer_config)
    if config is None or config.kv_connector != "OffloadingConnector":
        return None
    directory, size = config.extra.get("disk_dir"), config.extra.get("disk_bytes")
    if directory is None and size is None:
        return None
    if not isinstance(directory, str) or not directory:
        raise ValueError("kv_connector_extra_config.disk_bytes needs disk_dir, a directory")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError("kv_connector_extra_config.disk_dir needs disk_bytes, a positive integer")
    return directory, size
