"""The engine's RL-training controls: pause / resume, weight updates, weight versions.

A trainer pauses generation, sends new weights, and resumes:

- `pause(mode)`: "abort" ends every request now (each gets its partial
  output and finish reason "abort"); "wait" lets the admitted requests
  finish; "keep" freezes them, state and KV blocks kept, until resume. In
  every mode requests that arrive while paused are held, not failed, for up
  to --paused-request-timeout seconds (then a 503).
- `init_weight_transfer_engine` / `update_weights`: the workers join the
  trainer's own torch.distributed group and take the tensors it broadcasts,
  or read them from safetensors files (the `file` backend); the workers
  refuse a bad update whole (worker/weight_transfer.py). Cached prefixes
  computed with the old weights are dropped.
- Weight versions: each update (or `finish_weight_update`) sets the
  version; every request's output tokens are stamped with the version that
  produced them, and its last delta carries the ranges.

EngineCore inherits this mixin; no torch here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.request import Request
from pagoda.engine_core.core.scheduler import Scheduler
from pagoda.engine_core.executor.base import Executor
from pagoda.protocol.messages import RequestDelta

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class TrainingControls:
    """Pause state, the weight-transfer backend and the weight version."""

    # Built by EngineCore.__init__.
    config: EngineConfig
    scheduler: Scheduler
    executor: Executor
    _compiling: dict[str, Request]
    _in_flight: Any

    def _init_training(self, device: str) -> None:
        self._pause_mode: str | None = None
        self._paused_deltas: list[tuple[Request, RequestDelta]] = []
        backend = self.config.weight_transfer_backend
        self.weight_transfer_backend = backend or ("nccl" if device == "cuda" else "gloo")
        self.weight_version: int | str = 0
        self._weights_changed = False  # any update so far: outputs carry versions
        self._weight_update_open = False  # between start_ and finish_weight_update
        self._weight_transfer_ready = False

    # ----------------------------------------------------------------- pause

    def pause(self, mode: str = "abort", clear_cache: bool = False) -> bool:
        """Stop generating (see the module's docstring for the modes)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self._pause_mode = mode
        self.scheduler.frozen = mode == "keep"
        if mode == "abort":
            admitted = [r for r in self.scheduler.requests.values() if not r.held]
            ended = self.scheduler.finish_requests([r.request_id for r in admitted], "abort")
            for request in ended:
                self._compiling.pop(request.request_id, None)
                delta = RequestDelta(request.request_id, [], finish_reason="abort")
                delta.weight_versions = request.weight_versions or None
                self._paused_deltas.append((request, delta))
        if clear_cache:
            self.scheduler.block_manager.reset_prefix_cache()
        logger.info("paused (%s)", mode)
        return True

    def resume(self) -> bool:
        """Generate again: frozen requests continue, held ones are admitted."""
        self._pause_mode = None
        self.scheduler.frozen = False
        for request in self.scheduler.waiting:
            request.held = False
        logger.info("resumed")
        return True

    def is_paused(self) -> bool:
        return self._pause_mode is not None

    def pause_state(self) -> dict[str, Any]:
        """Whether paused, how, and how many admitted requests are still unfinished."""
        admitted = sum(not r.held for r in self.scheduler.requests.values())
        return {"is_paused": self.is_paused(), "mode": self._pause_mode, "num_unfinished": admitted}

    def _hold(self, request: Request) -> None:
        """A request arriving while paused: kept waiting until resume."""
        if self._pause_mode is not None:
            request.held = True
            request.held_at = time.monotonic()

    def _has_paused_work(self) -> bool | None:
        """While paused, whether the busy loop has anything to do (None: not paused)."""
        if self._pause_mode is None:
            return None
        if self._paused_deltas or self._in_flight or self._held_expired():
            return True
        if self._pause_mode == "keep":
            return False
        return bool(self.scheduler.running) or any(not r.held for r in self.scheduler.waiting)

    def _held_expired(self) -> bool:
        limit = self.config.paused_request_timeout_s
        now = time.monotonic()
        return any(r.held and now - r.held_at > limit for r in self.scheduler.waiting)

    def _paused_outputs(self) -> list[tuple[Request, RequestDelta]]:
        """Deltas of requests ended by a pause, and of held ones that waited too long."""
        out, self._paused_deltas = self._paused_deltas, []
        if self._pause_mode is None or not self._held_expired():
            return out
        limit = self.config.paused_request_timeout_s
        now = time.monotonic()
        expired = [r for r in self.scheduler.waiting if r.held and now - r.held_at > limit]
        self.scheduler.finish_requests([r.request_id for r in expired], "error")
        message = f"the server is paused and did not resume within {limit:g} s; retry later"
        out += [
            (r, RequestDelta(r.request_id, [], "error", error=message, error_kind="paused"))
            for r in expired
        ]
        return out

    # -------------------------------------------------------- weight updates

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> bool:
        """Every worker rank joins the trainer's group (rank_offset + its rank)."""
        if not isinstance(init_info, dict):
            raise ValueError("init_info must be an object")
        self.executor.collective_rpc(
            "init_weight_transfer", (self.weight_transfer_backend, init_info)
        )
        self._weight_transfer_ready = True
        return True

    def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Load new weights on every rank: broadcast by the trainer, or from
        `update_info.path` with the file backend. Returns how many tensors."""
        if not isinstance(update_info, dict):
            raise ValueError("update_info must be an object")
        if self.weight_transfer_backend == "file" or "path" in update_info:
            path = update_info.get("path")
            names = update_info.get("names")
            if not isinstance(path, str) or not path:
                raise ValueError("update_info.path must name a safetensors file or directory")
            if names is not None and (
                not isinstance(names, list) or not all(isinstance(n, str) for n in names)
            ):
                raise ValueError("update_info.names must be a list of tensor names")
            counts = self.executor.collective_rpc("load_weights_from_file", (path, names))
        else:
            if not self._weight_transfer_ready:
                raise ValueError(
                    "no weight transfer group: POST /init_weight_transfer_engine first"
                )
            counts = self.executor.collective_rpc("receive_weights", (update_info,))
        # Prefixes cached from the old weights would be stale.
        self.scheduler.block_manager.reset_prefix_cache()
        version = update_info.get("weight_version")
        if version is not None:
            self._set_weight_version(version)
        elif not self._weight_update_open:
            self._set_weight_version(None)
        return {"num_tensors": int(counts[0]), "weight_version": self.weight_version}

    def start_weight_update(self) -> bool:
        """Open an update that may take several update_weights calls."""
        self._weight_update_open = True
        return True

    def finish_weight_update(self, weight_version: int | str | None = None) -> dict[str, Any]:
        """Close the update: its tokens from now on carry `weight_version`."""
        self._weight_update_open = False
        self._set_weight_version(weight_version)
        return {"weight_version": self.weight_version}

    def weight_info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version}

    def get_world_size(self) -> int:
        return self.config.world_size

    def weight_checker(
        self, action: str = "checksum", baseline: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """ "checksum": sha256 of every tensor the serving weights were built
        from, by name. "compare": those against `baseline` (name: sha256), the
        names that differ and those the model does not have."""
        if action not in ("checksum", "compare"):
            raise ValueError(f"action must be 'checksum' or 'compare', got {action!r}")
        sums = self.executor.collective_rpc("weight_checksums")
        if any(s != sums[0] for s in sums[1:]):
            raise RuntimeError("the worker ranks hold different weights")
        checksums: dict[str, str] = sums[0]
        if action == "checksum":
            return {"weight_version": self.weight_version, "checksums": checksums}
        if not isinstance(baseline, dict) or not baseline:
            raise ValueError("compare needs a baseline: {tensor name: sha256}")
        mismatched = sorted(n for n, d in baseline.items() if n in checksums and checksums[n] != d)
        unknown = sorted(n for n in baseline if n not in checksums)
        return {
            "weight_version": self.weight_version,
            "match": not mismatched and not unknown,
            "mismatched": mismatched,
            "unknown": unknown,
        }

    def _set_weight_version(self, version: int | str | None) -> None:
        if version is None:
            current = self.weight_version
            version = current + 1 if isinstance(current, int) else 1
        if isinstance(version, bool) or not isinstance(version, int | str):
            raise ValueError("weight_version must be an integer or a string")
        self.weight_version = version
        self._weights_changed = True
        logger.info("weight version %s", version)

    def _stamp_versions(self, deltas: list[tuple[Request, RequestDelta]]) -> None:
        """Note which weights made each new token; a last delta carries the
        ranges. Nothing is noted until the first update: tokens before a
        request's first range are the checkpoint's (version 0)."""
        if not self._weights_changed:
            return
        version = self.weight_version
        for request, delta in deltas:
            if delta.new_token_ids:
                request.note_weight_version(version, len(delta.new_token_ids))
            if delta.finish_reason is not None:
                ranges = request.weight_versions
                first = ranges[0][1] if ranges else request.num_output_tokens
                if first > 0:
                    ranges.insert(0, (0, 0, first))
                delta.weight_versions = ranges or None
