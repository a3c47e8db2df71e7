"""Executors: how the engine core reaches its workers (see base.py)."""

from __future__ import annotations

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.executor.base import Executor, ExecutorError

__all__ = ["Executor", "ExecutorError", "create_executor", "device_type"]
from pagoda.engine_core.model_config import ModelConfig


def create_executor(config: EngineConfig, model_config: ModelConfig) -> Executor:
    """The executor for this config; its workers are loaded when this returns."""
    from pagoda.engine_core.worker.parallel import (
        check_expert_parallel_engines,
        check_pipeline_parallel,
        check_tensor_parallel,
    )

    check_tensor_parallel(model_config, config.tensor_parallel_size, config.enable_expert_parallel)
    check_pipeline_parallel(model_config, config.pipeline_parallel_size)
    if config.expert_parallel_engines:
        check_expert_parallel_engines(model_config, config)
    if config.enable_lora and model_config.moe is not None:
        raise ValueError("LoRA adapters on mixture-of-experts models are not supported yet")
    backend = config.executor_backend
    if backend == "uni":
        from pagoda.engine_core.executor.uni import UniExecutor

        return UniExecutor(config, model_config)
    if backend == "mp":
        from pagoda.engine_core.executor.mp import MPExecutor

        return MPExecutor(config, model_config)
    if backend == "ray":
        try:
            import ray  # noqa: F401 - an optional dependency
        except ImportError as e:
            raise ValueError("the ray executor needs Ray: pip install 'pagoda[ray]'") from e
        from pagoda.engine_core.executor.ray import RayExecutor

        return RayExecutor(config, model_config)
    raise ValueError(f"the {backend} executor is not available yet; use uni, mp or ray")


def device_type(config: EngineConfig) -> str:
    """ "cpu" or "cuda": where this config's workers will run."""
    from pagoda.engine_core.worker.worker import device_type as worker_device_type

    return worker_device_type(config)
