"""The `uni` executor: one worker, in the engine-core process."""

from __future__ import annotations

from typing import Any

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.plan import SchedulePlan, StepResult
from pagoda.engine_core.executor.base import Executor
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.worker.worker import Worker


class UniExecutor(Executor):
    """Calls the single worker directly: no copies, no channel."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.worker = Worker(config, model_config, rank=0)

    def initialize_kv_cache(self) -> int:
        return self.worker.initialize_kv_cache()

    def execute(self, plan: SchedulePlan) -> StepResult:
        return self.worker.execute_model(plan)

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def check_health(self) -> None:
        self.worker.check_health()

    def shutdown(self) -> None:
        self.worker.shutdown()
