"""The engine core dies (kill -9) and comes back at the same address.

In-flight requests fail at once, /health turns 503 within 2 s, and the API
server reconnects to the new engine core and serves again without a restart.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME
from tests.frontend.servers import Processes, api_argv, engine_argv, free_port, wait_healthy

pytestmark = pytest.mark.slow


def test_api_server_survives_an_engine_restart(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/engine"
    procs = Processes()
    engine = procs.start(engine_argv(address, *ENGINE_FLAGS), "engine-first")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api = procs.start(api_argv(address, port), "api-restart")
    try:
        wait_healthy(base, procs)
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        before = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert before.status_code == 200

        stream_body = {**body, "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=stream_body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # generating now
            os.kill(engine.pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line]
        # The stream ends at once with an error event, then [DONE].
        assert time.monotonic() - killed < 2.0
        assert rest[-1] == "data: [DONE]" and "engine core" in rest[-2], rest[-3:]
        while httpx.get(base + "/health").status_code != 503:
            assert time.monotonic() - killed < 2.0
            time.sleep(0.05)
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "engine core" in r.json()["error"]["message"]

        engine.wait()
        procs.procs.remove(engine)
        procs.start(engine_argv(address, *ENGINE_FLAGS), "engine-second")
        wait_healthy(base, procs)
        assert api.poll() is None  # the same API server process
        after = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    finally:
        procs.stop()
