"""Executor: the only door from the engine core to its workers.

The engine core calls these things and nothing else of the compute side:
`initialize_kv_cache()`, `execute(plan)` (or `submit(plan)` then
`collect()`, to keep several steps in flight through pipeline stages),
`collective_rpc(method, ...)`, `check_health()`, `shutdown()`. What crosses is plain data
(engine_core/core/plan.py), so the workers may live in this process (`uni`),
in a process per local rank (`mp`, one module beside this one) or in Ray
actors (`ray`, likewise): each is a subclass here, chosen by
`create_executor`.
"""

from __future__ import annotations

import typing
from abc import ABC, abstractmethod
from collections import deque
from typing import Any

import msgspec

from pagoda.engine_core.core.plan import SchedulePlan, StepResult


class ExecutorError(RuntimeError):
    """A worker died, hung past its time limit or could not start: the engine
    cannot go on (the message names the rank)."""


class Executor(ABC):
    """Runs each step's plan on every worker; the result comes from the one that samples."""

    @abstractmethod
    def initialize_kv_cache(self) -> int:
        """Allocate every rank's KV cache; returns the number of blocks (the same on all)."""

    @abstractmethod
    def execute(self, plan: SchedulePlan) -> StepResult:
        """Run one step on every rank."""

    def submit(self, plan: SchedulePlan) -> None:
        """Start a step; its result comes from `collect()`, results in the order
        their plans were submitted. Executors whose ranks work concurrently
        return at once, so the next plan can enter the first pipeline stage
        while this one is in the later ones; here it runs the step now."""
        if not hasattr(self, "_results"):
            self._results: deque[StepResult] = deque()
        self._results.append(self.execute(plan))

    def collect(self) -> StepResult:
        """The result of the oldest submitted step not yet collected."""
        return self._results.popleft()

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call a Worker method by name on every rank; its results, in rank order.

        Arguments and results are plain values. A rank's exception is raised
        here (the first, in rank order).
        """

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is dead or unresponsive."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free what they hold."""


class RankExecutor(Executor):
    """What the executors with a worker per rank (`mp`, `ray`) share: the KV
    cache sized by the rank with the least room, a step as submit + collect,
    and a rank's failure as the exception the engine expects."""

    def initialize_kv_cache(self) -> int:
        blocks = self.collective_rpc("initialize_kv_cache")
        if len(set(blocks)) != 1:
            # Ranks with different free memory: every rank takes the smallest.
            least = min(blocks)
            self.collective_rpc("initialize_kv_cache", (least,))
            return int(least)
        return int(blocks[0])

    def execute(self, plan: SchedulePlan) -> StepResult:
        self.submit(plan)
        return self.collect()

    @abstractmethod
    def submit(self, plan: SchedulePlan) -> None: ...

    @abstractmethod
    def collect(self) -> StepResult: ...


def raise_rank_error(rank: int, payload: bytes, what: str) -> None:
    """Raise a rank's reported error (worker/proc.py's error_payload): at start,
    an ExecutorError naming the rank; in a call, ValueError for the caller's
    mistakes (the engine reports them and goes on), else RuntimeError."""
    error = msgspec.msgpack.decode(payload)
    message = f"{error['message']}"
    if what == "start":
        raise ExecutorError(f"worker rank {rank} could not start: {message}")
    exc = ValueError(message) if error.get("caller") else RuntimeError(message)
    if error.get("kind"):
        exc.kind = error["kind"]  # type: ignore[union-attr]
    raise exc


def return_type(method: str) -> Any:
    """What a Worker method returns, for decoding its results as typed values."""
    from pagoda.engine_core.worker.worker import Worker

    function = getattr(Worker, method, None)
    if function is None:
        return Any
    hints = typing.get_type_hints(function)
    kind = hints.get("return", Any)
    return Any if kind is type(None) else kind
