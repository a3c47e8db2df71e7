"""The scheduler side of the engine and the protocol import no torch."""

from __future__ import annotations

from tests.no_torch import assert_imports_no_torch

TORCH_FREE_MODULES = (
    "protocol",
    "protocol.messages",
    "protocol.sampling_params",
    "engine_core.config",
    "engine_core.request",
    "engine_core.plan",
    "engine_core.block_manager",
    "engine_core.scheduler",
    "engine_core.lora_slots",
    "engine_core.lora_manager",
    "engine_core.model_config",
)


def test_scheduler_side_imports_no_torch() -> None:
    assert_imports_no_torch(TORCH_FREE_MODULES)
