"""The engine's control calls: cache reset, profiling, sleep / wake-up, LoRA admin, stats.

They reach the engine as utility calls (by method name) from the API servers
and the SDK. EngineCore inherits them; this mixin only reads and flips the
state EngineCore builds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.kv_connector import PeerConnector
from pagoda.engine_core.core.lora_manager import LoRAManager
from pagoda.engine_core.core.request import Request
from pagoda.engine_core.core.scheduler import Scheduler
from pagoda.engine_core.executor.base import Executor

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")


class EngineBusyError(ValueError):
    """A control call refused because requests are in flight."""


class EngineUtilities:
    """Control calls over EngineCore's scheduler, executor and LoRA registry."""

    # Built by EngineCore.__init__.
    config: EngineConfig
    engine_id: str
    scheduler: Scheduler
    executor: Executor
    lora: LoRAManager | None
    _profiling: bool  # a trace is running on the workers
    _asleep: set[str]  # which of SLEEP_TAGS are out of memory now
    _compiling: dict[str, Request]
    peer: PeerConnector | None  # --kv-transfer-config's PeerConnector

    def reset_prefix_cache(self) -> bool:
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    def start_profile(self) -> bool:
        """Start a torch.profiler trace of the workers' steps."""
        if self.config.profiler_dir is None:
            raise ValueError("profiling is off: start the engine with --profiler-dir DIR")
        if self._profiling:
            raise ValueError("a profile is already running")
        self.executor.collective_rpc("start_profile")
        self._profiling = True
        return True

    def stop_profile(self) -> str:
        """Stop the trace; returns the path of rank 0's Chrome/Perfetto trace file."""
        if not self._profiling:
            raise ValueError("no profile is running")
        self._profiling = False
        assert self.config.profiler_dir is not None
        paths = self.executor.collective_rpc(
            "stop_profile", (self.config.profiler_dir, f"pagoda-engine-{self.engine_id}")
        )
        return str(paths[0])

    def sleep(self, level: int = 1) -> bool:
        """Free the KV cache and park (1) or drop (2) the weights; refused mid-request."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        busy = self.scheduler.num_unfinished + len(self._compiling)
        if busy:
            raise EngineBusyError(
                f"{busy} requests are in flight; sleep is refused until they finish or are aborted"
            )
        started = time.monotonic()
        # The cached prefixes live in the KV cache about to be freed, and so do
        # the blocks held for decode engines (they will find nothing and compute).
        self.scheduler.block_manager.reset_prefix_cache()
        if self.peer is not None:
            for key in self.peer.drop_held():
                self.scheduler.block_manager.release(key)
        self.executor.collective_rpc("sleep", (level, self.config.sleep_offload_dir))
        self._asleep = set(SLEEP_TAGS)
        logger.info("asleep at level %d in %.2f s", level, time.monotonic() - started)
        return True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back the weights and/or the KV cache (all when tags is None)."""
        wanted = set(SLEEP_TAGS if not tags else tags)
        unknown = wanted - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use weights, kv_cache")
        todo = wanted & self._asleep
        started = time.monotonic()
        self.executor.collective_rpc(
            "wake_up",
            ("weights" in todo, "kv_cache" in todo, self.scheduler.block_manager.num_blocks),
        )
        self._asleep -= todo
        logger.info("woke %s in %.2f s", sorted(todo) or "nothing", time.monotonic() - started)
        return True

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora")
        return self.lora

    def add_lora(self, lora_name: str, lora_path: str, lora_int_id: int = 0) -> dict[str, Any]:
        """Register a PEFT adapter under a model name; loaded into a slot when first used."""
        self._lora_manager().add(lora_name, lora_path, lora_int_id)
        return next(d for d in self._lora_manager().describe() if d["lora_name"] == lora_name)

    def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter; refused while a queued or running request uses it."""
        in_use = any(r.lora_name == lora_name for r in self.scheduler.requests.values())
        self._lora_manager().remove(lora_name, in_use)
        return True

    def pin_lora(self, lora_name: str) -> bool:
        """Load an adapter now and never evict it."""
        wanted = {r.lora_name for r in self.scheduler.requests.values() if r.lora_name}
        self._lora_manager().pin(lora_name, wanted)
        return True

    def list_loras(self) -> list[dict[str, Any]]:
        return self._lora_manager().describe() if self.lora is not None else []

    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def check_invariants(self) -> bool:
        """The block manager's consistency check (raises if broken)."""
        self.scheduler.block_manager.check_invariants()
        if self.lora is not None:
            self.lora.slots.check_invariants()
        return True

    def get_stats(self) -> dict[str, Any]:
        bm = self.scheduler.block_manager
        bm.check_invariants()
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks,
            "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "is_sleeping": bool(self._asleep),
        }
