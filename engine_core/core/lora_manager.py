"""LoRAManager: the engine's registry of adapters and its add/remove/pin/list calls.

Imports no torch: the workers (reached through the executor, `WorkerLoRA`)
read the weights and own the device slots; this class keeps names, paths, ranks and pins, and
the LoRASlots table the scheduler consults. Every registered adapter is
kept in host memory, so a request for one that was evicted from its slot
reloads it from there, never from disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pagoda.engine_core.core.lora_slots import LoRASlots
from pagoda.engine_core.executor.base import Executor
from pagoda.protocol.messages import LoRARequest


class LoRAError(ValueError):
    """A refused LoRA call; `kind` is "not_found", "invalid" or "busy"."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


class LoRARunner(Protocol):
    def register_lora(self, name: str, path: str) -> int: ...
    def unregister_lora(self, name: str) -> None: ...
    def load_lora(self, slot: int, name: str) -> None: ...


class WorkerLoRA:
    """The LoRARunner calls, made on every worker through the executor."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def register_lora(self, name: str, path: str) -> int:
        return int(self.executor.collective_rpc("register_lora", (name, path))[0])

    def unregister_lora(self, name: str) -> None:
        self.executor.collective_rpc("unregister_lora", (name,))

    def load_lora(self, slot: int, name: str) -> None:
        self.executor.collective_rpc("load_lora", (slot, name))


@dataclass
class LoRAEntry:
    """One registered adapter."""

    name: str
    lora_id: int  # the engine's registration id (the prefix cache keys by it)
    user_id: int  # the caller's lora_int_id
    path: str
    rank: int


class LoRAManager:
    """Registered adapters and their slots."""

    def __init__(self, runner: LoRARunner, max_loras: int) -> None:
        self.runner = runner
        self.slots = LoRASlots(max_loras)
        self.entries: dict[str, LoRAEntry] = {}
        self._next_id = 1

    def add(self, name: str, path: str, user_id: int = 0) -> LoRAEntry:
        """Register an adapter (LoRAError: duplicate name, bad path, bad adapter)."""
        if not isinstance(name, str) or not name:
            raise LoRAError("lora_name must be a non-empty string")
        if not isinstance(path, str) or not path:
            raise LoRAError("lora_path must be a non-empty string")
        if name in self.entries:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        try:
            rank = self.runner.register_lora(name, path)
        except ValueError as e:
            raise LoRAError(str(e), getattr(e, "kind", "invalid")) from None
        entry = LoRAEntry(name, self._next_id, user_id or self._next_id, path, rank)
        self._next_id += 1
        self.entries[name] = entry
        return entry

    def get(self, name: str) -> LoRAEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.", "not_found")
        return entry

    def remove(self, name: str, in_use: bool) -> None:
        """Forget an adapter; refused ("busy") while requests use it."""
        self.get(name)
        if in_use:
            raise LoRAError(
                f"The lora adapter '{name}' is used by requests in flight; retry when they finish",
                "busy",
            )
        self.slots.remove(name)
        self.runner.unregister_lora(name)
        del self.entries[name]

    def pin(self, name: str, wanted: set[str]) -> None:
        """Keep the adapter in a slot for good (loaded now).

        `wanted`: the adapters of queued and running requests. Pinning the last
        slot is refused while one of them is not pinned: it could never run.
        """
        self.get(name)
        pinned = self.slots.pinned | {name}
        stranded = sorted(wanted - pinned)
        if len(pinned) >= self.slots.max_loras and stranded:
            raise LoRAError(
                f"pinning '{name}' would pin every LoRA slot while requests for "
                f"{stranded} are in flight",
                "busy",
            )
        try:
            self.slots.pin(name)
        except ValueError as e:
            raise LoRAError(str(e), "busy") from None
        for slot, loaded in self.slots.take_pending_loads():
            self.runner.load_lora(slot, loaded)

    def check_runnable(self, name: str) -> str | None:
        """Why a request for this adapter could never run, or None."""
        slots = self.slots
        if name not in slots.pinned and len(slots.pinned) >= slots.max_loras:
            return (
                f"all {slots.max_loras} LoRA slots are pinned to other adapters; "
                f"the adapter '{name}' cannot be loaded"
            )
        return None

    def resolve(self, request: LoRARequest) -> LoRAEntry:
        """The entry a request names, registering it from its path when new."""
        entry = self.entries.get(request.lora_name)
        if entry is not None:
            return entry
        if not request.lora_path:
            raise LoRAError(f"The lora adapter '{request.lora_name}' cannot be found.", "not_found")
        return self.add(request.lora_name, request.lora_path, request.lora_int_id)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "lora_name": e.name,
                "lora_int_id": e.user_id,
                "lora_path": e.path,
                "rank": e.rank,
                "pinned": e.name in self.slots.pinned,
                "slot": self.slots.slot_of.get(e.name, 0),
            }
            for e in self.entries.values()
        ]

    def requests(self) -> list[LoRARequest]:
        return [LoRARequest(e.name, e.user_id, e.path) for e in self.entries.values()]
