"""The scheduler side of the engine and the protocol import no torch."""

from __future__ import annotations

from tests.no_torch import assert_imports_no_torch

TORCH_FREE_MODULES = (
    "pagoda",
    "pagoda.protocol",
    "pagoda.protocol.messages",
    "pagoda.protocol.sampling_params",
    "pagoda.engine_core.config",
    "pagoda.engine_core.core.request",
    "pagoda.engine_core.core.plan",
    "pagoda.engine_core.core.block_manager",
    "pagoda.engine_core.core.scheduler",
    "pagoda.engine_core.core.lora_slots",
    "pagoda.engine_core.core.lora_manager",
    "pagoda.engine_core.model_config",
)


def test_scheduler_side_imports_no_torch() -> None:
    assert_imports_no_torch(TORCH_FREE_MODULES)
