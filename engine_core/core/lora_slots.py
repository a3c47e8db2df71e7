"""LoRASlots: which adapters hold the `max_loras` device slots. Imports no torch.

Slots are 1..max_loras (0 means "no adapter"). An adapter in a slot is
resident; running requests hold a reference on it. To make room, the least
recently used resident adapter that no running request uses and that is not
pinned is evicted; a pinned adapter keeps its slot until it is unpinned or
removed. The scheduler asks `can_acquire` before it admits a LoRA request,
so a batch never names more adapters than there are slots.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlots:
    """Slot assignment, LRU order, pins and use counts of the resident adapters."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # LRU first
        self.pinned: set[str] = set()
        self.num_users: dict[str, int] = {}
        # (slot, name) loads the runner must do before the next forward pass.
        self.pending_loads: list[tuple[int, str]] = []

    def _free_slot(self) -> int | None:
        used = set(self.slot_of.values())
        return next((s for s in range(1, self.max_loras + 1) if s not in used), None)

    def _victim(self) -> str | None:
        return next(
            (n for n in self.slot_of if n not in self.pinned and not self.num_users.get(n)), None
        )

    def can_acquire(self, name: str) -> bool:
        return name in self.slot_of or self._free_slot() is not None or self._victim() is not None

    def acquire(self, name: str, use: bool = True) -> int:
        """The adapter's slot, loading it (and evicting the LRU one) if it is not resident."""
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                victim = self._victim()
                assert victim is not None, "acquire without can_acquire"
                slot = self.slot_of.pop(victim)
            self.slot_of[name] = slot
            self.pending_loads.append((slot, name))
        self.slot_of.move_to_end(name)
        if use:
            self.num_users[name] = self.num_users.get(name, 0) + 1
        return slot

    def release(self, name: str) -> None:
        """A request of this adapter left the running set."""
        left = self.num_users.get(name, 0) - 1
        assert left >= 0, f"LoRA {name!r} released more often than acquired"
        if left:
            self.num_users[name] = left
        else:
            self.num_users.pop(name, None)

    def pin(self, name: str) -> int:
        """Make the adapter resident for good; ValueError when every slot is pinned."""
        if name not in self.slot_of and not self.can_acquire(name):
            raise ValueError(
                f"cannot pin LoRA {name!r}: all {self.max_loras} slots are pinned or in use"
            )
        slot = self.acquire(name, use=False)
        self.pinned.add(name)
        return slot

    def remove(self, name: str) -> None:
        """Forget a resident adapter (the caller checked it has no users)."""
        self.slot_of.pop(name, None)
        self.pinned.discard(name)
        self.pending_loads = [(s, n) for s, n in self.pending_loads if n != name]

    def take_pending_loads(self) -> list[tuple[int, str]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def check_invariants(self) -> None:
        slots = list(self.slot_of.values())
        assert len(slots) == len(set(slots)), "two adapters share a slot"
        assert all(1 <= s <= self.max_loras for s in slots), "slot out of range"
        assert self.pinned <= set(self.slot_of), "a pinned adapter is not resident"
        assert set(self.num_users) <= set(self.slot_of), "a used adapter is not resident"
