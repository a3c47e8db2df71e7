"""The scheduler side of the engine and the protocol import no torch."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE_MODULES = (
    "protocol",
    "protocol.messages",
    "protocol.sampling_params",
    "engine_core.config",
    "engine_core.request",
    "engine_core.plan",
    "engine_core.block_manager",
    "engine_core.scheduler",
    "engine_core.model_config",
)


def test_scheduler_side_imports_no_torch() -> None:
    # A fresh interpreter: this one has torch loaded by other tests.
    code = "\n".join(
        [
            "import importlib, sys",
            *(f"importlib.import_module({name!r})" for name in TORCH_FREE_MODULES),
            "print('torch' in sys.modules)",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "torch was imported"
