"""Data-parallel engine cores behind one API server: least-loaded routing, aborts
to the owning engine, and the engines' stats summed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagoda.protocol.addresses import dp_addresses
from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME
from tests.frontend.servers import Processes, api_argv, engine_argv, free_port, wait_healthy


def test_dp_addresses() -> None:
    assert dp_addresses("ipc:///r/engine", 1) == ["ipc:///r/engine"]
    assert dp_addresses("ipc:///r/engine", 3) == [
        "ipc:///r/engine",
        "ipc:///r/engine-dp1",
        "ipc:///r/engine-dp2",
    ]
    assert dp_addresses("tcp://127.0.0.1:7000", 2) == [
        "tcp://127.0.0.1:7000",
        "tcp://127.0.0.1:7002",
    ]


@pytest.mark.slow
def test_two_engines_share_the_load(tmp_path: Path) -> None:
    addresses = dp_addresses(f"ipc://{tmp_path}/engine", 2)
    procs = Processes()
    engines = [
        procs.start(engine_argv(a, *ENGINE_FLAGS, "--num-threads", "1"), f"engine-dp{i}")
        for i, a in enumerate(addresses)
    ]
    port = free_port()
    procs.start(api_argv(",".join(addresses), port), "api-dp")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs)
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)

        async def burst() -> list[str]:
            outs = await asyncio.gather(
                *(
                    c.completions.create(
                        model=MODEL_NAME, prompt="The sky is", max_tokens=12, temperature=0
                    )
                    for _ in range(8)
                )
            )
            return [o.choices[0].text for o in outs]

        texts = asyncio.run(burst())
        assert len(set(texts)) == 1  # same weights, greedy: the same text on either engine
        stats = httpx.get(base + "/stats", timeout=30).json()
        assert len(stats["engines"]) == 2
        assert all(n >= 2 for n in stats["num_routed"]), stats["num_routed"]
        # A cancelled stream is aborted on the engine that has it: nothing left running.
        body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 500, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = httpx.get(base + "/stats", timeout=30).json()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
            time.sleep(0.2)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
        assert httpx.post(base + "/reset_prefix_cache", timeout=30).status_code == 200
        # One engine core gone: health says so.
        os.kill(engines[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        procs.stop()
