"""Executor: the seam between the engine core and its model runner(s).

The engine core only ever calls `executor.execute(plan)`. Today one runner
lives in this process; a multi-process executor for tensor parallelism can
take its place without touching the engine core.
"""

from __future__ import annotations

from engine_core.config import EngineConfig
from engine_core.encoder_runner import EncoderRunner
from engine_core.model_config import ModelConfig
from engine_core.model_runner import ModelRunner
from engine_core.plan import SchedulePlan, StepResult


class InProcessExecutor:
    """Runs the single model runner in the engine-core process."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.runner: ModelRunner | EncoderRunner
        if model_config.is_encoder:
            self.runner = EncoderRunner(config, model_config)
        else:
            self.runner = ModelRunner(config, model_config)

    def initialize_kv_cache(self) -> int:
        return self.runner.allocate_kv_cache()

    def execute(self, plan: SchedulePlan) -> StepResult:
        return self.runner.execute(plan)

    def sleep(self, level: int, spill_dir: str | None) -> None:
        """Free the KV cache; park the weights (level 1) or drop them (level 2)."""
        if isinstance(self.runner, EncoderRunner):
            raise RuntimeError("sleep mode is not supported for encoder (pooling) models")
        self.runner.release_kv_cache()
        self.runner.offload_weights(keep_copy=level == 1, spill_dir=spill_dir)

    def wake_up(self, weights: bool, kv_cache: bool, num_blocks: int) -> None:
        if isinstance(self.runner, EncoderRunner):
            return  # never asleep
        if weights:
            self.runner.reload_weights()
        if kv_cache:
            self.runner.allocate_kv_cache(num_blocks)

    @property
    def dtype_name(self) -> str:
        return str(self.runner.dtype).removeprefix("torch.")
