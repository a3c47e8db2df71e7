"""Check, in a fresh interpreter, that importing some modules leaves torch out."""

from __future__ import annotations

import subprocess
import sys


def assert_imports_no_torch(modules: tuple[str, ...]) -> None:
    # A fresh interpreter: the test process has torch loaded by other tests.
    code = "\n".join(
        [
            "import importlib, sys",
            *(f"importlib.import_module({name!r})" for name in modules),
            "print('torch' in sys.modules)",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"importing {modules} imported torch"
