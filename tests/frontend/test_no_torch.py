"""The API server side never imports torch."""

from __future__ import annotations

import subprocess
import sys

FRONTEND_MODULES = (
    "frontend",
    "frontend.cli",
    "frontend.pagoda_cli",
    "frontend.api.app",
    "frontend.async_llm",
    "frontend.engine_client",
    "frontend.output_processor",
    "frontend.processor",
    "frontend.tokenizer",
    "engine_core.addresses",
    "engine_core.args",
    "engine_core.envs",
)


def test_frontend_imports_no_torch() -> None:
    code = "\n".join(
        [
            "import importlib, sys",
            *(f"importlib.import_module({name!r})" for name in FRONTEND_MODULES),
            "print('torch' in sys.modules)",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "torch was imported by the frontend"
