"""A stuck engine or a client that stops reading never blocks anybody else."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME, Server
from tests.frontend.servers import Processes, api_argv, engine_argv, free_port, wait_healthy

pytestmark = pytest.mark.slow


def _timed_get(url: str) -> tuple[int, float]:
    started = time.monotonic()
    status = httpx.get(url, timeout=10).status_code
    return status, time.monotonic() - started


def _read_stream(url: str, body: dict[str, object], lines: list[tuple[float, str]]) -> None:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append((time.monotonic(), line))


# The engine stays stopped this long: past the API server's 5 s silence limit
# (frontend/engine_client.py ENGINE_SILENCE_LIMIT_S), as in issue 9's fault list.
STOP_S = 10.0


def test_stopped_engine_never_stalls_the_api_server(tmp_path: Path) -> None:
    procs = Processes()
    address = f"ipc://{tmp_path}/engine"
    engine = procs.start(engine_argv(address, *ENGINE_FLAGS), "engine-stuck")
    port = free_port()
    procs.start(api_argv(address, port), "api-stuck")
    base = f"http://127.0.0.1:{port}"
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    try:
        wait_healthy(base, procs)
        # A long stream is open when the engine stops.
        lines: list[tuple[float, str]] = []
        body = {"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=_read_stream, args=(base + "/v1/completions", body, lines))
        reader.start()
        deadline = time.monotonic() + 60
        while len(lines) < 2:
            assert time.monotonic() < deadline and reader.is_alive(), lines
            time.sleep(0.05)
        os.kill(engine.pid, signal.SIGSTOP)  # a step that never ends
        stopped = time.monotonic()
        try:
            # The HTTP side keeps answering at once; health turns 503 once the
            # engine has been silent past the limit.
            deadline = time.monotonic() + 15
            saw_503 = False
            while time.monotonic() < deadline and not saw_503:
                for path in ("/v1/models", "/load", "/metrics"):
                    status, took = _timed_get(base + path)
                    assert status == 200 and took < 1.0, (path, status, took)
                status, took = _timed_get(base + "/health")
                assert took < 3.0
                saw_503 = status == 503
                time.sleep(0.3)
            assert saw_503
            # The open stream ended with an error event, not a hang.
            reader.join(timeout=5)
            assert not reader.is_alive()
            assert lines[-1][1] == "data: [DONE]", lines[-2:]
            assert "engine core" in lines[-2][1] and '"error"' in lines[-2][1], lines[-2:]
            assert lines[-2][0] - stopped < 9.0
            with pytest.raises(openai.APIStatusError) as refused:
                c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
            assert refused.value.status_code == 503
            time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped)))
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        resumed = time.monotonic()
        # The engine resumes: the API server hears it again and serves.
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        print(f"healthy {time.monotonic() - resumed:.2f} s after SIGCONT")
        # The failed stream's request was aborted in the engine too: it does
        # not run on to max_tokens holding KV blocks (/stats checks the block
        # manager's invariants).
        deadline = time.monotonic() + 5
        while True:
            stats = httpx.get(base + "/stats", timeout=10).json()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        assert stats["num_used_blocks"] == 0, stats
        out = c.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
        assert procs.stop() == [0, 0]
    finally:
        procs.stop()


def test_a_client_that_stops_reading_blocks_nobody(server: Server) -> None:
    # A raw socket that asks for a long stream and never reads it.
    host, port = server.base_url.removeprefix("http://").split(":")
    body = (
        f'{{"model": "{MODEL_NAME}", "prompt": "Count to a thousand:", '
        '"max_tokens": 600, "ignore_eos": true, "stream": true}'
    )
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    lost = socket.create_connection((host, int(port)))
    lost.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        lost.sendall(request.encode())
        time.sleep(1.0)
        c = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)
        started = time.monotonic()
        for _ in range(3):
            out = c.completions.create(
                model=MODEL_NAME, prompt="Hi", max_tokens=8, extra_body={"ignore_eos": True}
            )
            assert out.usage is not None and out.usage.completion_tokens == 8
        assert time.monotonic() - started < 30
    finally:
        lost.close()
