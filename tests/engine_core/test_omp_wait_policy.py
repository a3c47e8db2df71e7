"""engine-core sets OpenMP's wait policy before torch loads it, unless the user did."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = (
    "import sys, os, engine_core.cli; "
    "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))"
)


def run_probe(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(extra_env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_passive_by_default_and_set_before_torch() -> None:
    # torch must not be loaded yet: OpenMP reads the variable once, when it loads.
    assert run_probe({}) == "False PASSIVE"


def test_user_value_wins() -> None:
    assert run_probe({"OMP_WAIT_POLICY": "ACTIVE"}) == "False ACTIVE"
