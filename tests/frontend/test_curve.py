"""CURVE keys on a tcp engine: only API servers holding an admitted key connect."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import openai
import pytest

from pagoda.protocol.curve import bind_address, generate_keys
from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME
from tests.frontend.servers import (
    REPO,
    Processes,
    api_argv,
    engine_argv,
    engine_tcp_ports,
    free_port,
    wait_healthy,
)


def test_key_directory_is_private(tmp_path: Path) -> None:
    root = generate_keys(tmp_path / "keys")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    for secret in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(root / secret).st_mode) == 0o600
    assert (root / "clients" / "client.key").exists()
    with pytest.raises(FileExistsError):
        generate_keys(root)


def test_tcp_without_keys_binds_loopback() -> None:
    assert bind_address("tcp://0.0.0.0:5555", None) == "tcp://127.0.0.1:5555"
    assert bind_address("tcp://10.1.2.3:5555", None) == "tcp://127.0.0.1:5555"
    assert bind_address("tcp://127.0.0.1:5555", None) == "tcp://127.0.0.1:5555"
    assert bind_address("tcp://[::1]:5555", None) == "tcp://[::1]:5555"
    assert bind_address("tcp://0.0.0.0:5555", "/keys") == "tcp://0.0.0.0:5555"
    assert bind_address("ipc:///tmp/x/engine", None) == "ipc:///tmp/x/engine"


@pytest.mark.slow
def test_only_admitted_keys_connect(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys")
    # Another key pair that knows the engine's public key but is not admitted.
    stranger = generate_keys(tmp_path / "stranger")
    shutil.copy(keys / "server.key", stranger / "server.key")
    engine_port, port = engine_tcp_ports()
    address = f"tcp://127.0.0.1:{engine_port}"
    procs = Processes()
    procs.start(engine_argv(address, *ENGINE_FLAGS, "--curve-keys", str(keys)), "engine-curve")
    procs.start(api_argv(address, port, "--curve-keys", str(keys)), "api-curve")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, procs)
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        out = c.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
        for extra in ([], ["--curve-keys", str(stranger)]):
            http = free_port(avoid=(engine_port, engine_port + 1))
            argv = api_argv(address, http, "--engine-timeout", "5", *extra)
            done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
            assert done.returncode == 3, done.stdout + done.stderr
    finally:
        procs.stop()
