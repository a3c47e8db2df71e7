"""Fixtures that run the real engine-core and api-server processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.frontend.servers import (
    Processes,
    api_argv,
    engine_argv,
    free_port,
    ipc_address,
    wait_healthy,
)

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# float32 so that greedy results can be compared exactly with the offline LLM.
ENGINE_FLAGS = (
    "--dtype",
    "float32",
    "--kv-cache-memory-bytes",
    str(384 << 20),
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "128",
)


@dataclass
class Server:
    base_url: str
    address: str
    procs: Processes

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """One engine core and one API server, shared by the end-to-end tests."""
    procs = Processes()
    address = ipc_address()
    port = free_port()
    procs.start(engine_argv(address, *ENGINE_FLAGS), "engine")
    procs.start(
        api_argv(address, port, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"), "api"
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs)
        yield Server(base, address, procs)
    finally:
        procs.stop()
