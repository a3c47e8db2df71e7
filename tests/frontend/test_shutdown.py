"""Graceful shutdown: SIGTERM drains (503 for new requests), then aborts the rest, exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME, Server
from tests.frontend.servers import REPO, Processes, api_argv, free_port, wait_healthy

pytestmark = pytest.mark.slow


def wait_load(base: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(base + "/load").json()["server_load"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def post_in_thread(
    base: str, body: dict[str, object]
) -> tuple[threading.Thread, list[httpx.Response]]:
    """Start a completion request in the background; its response lands in the list."""
    out: list[httpx.Response] = []

    def run() -> None:
        out.append(httpx.post(base + "/v1/completions", json=body, timeout=300))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_sigterm_lets_in_flight_requests_finish(server: Server) -> None:
    procs = Processes()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api = procs.start(api_argv(server.address, port, "--shutdown-timeout", "120"), "api-drain")
    try:
        wait_healthy(base, procs, timeout=60)
        # Long enough (seconds at any speed this suite runs at) to still be in
        # flight while the probes below run; a few tokens can finish, and the
        # drained server exit, before the first probe connects.
        body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 300, "ignore_eos": True}
        thread, result = post_in_thread(base, body)
        wait_load(base, 1)
        api.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        # Draining: new requests and health checks are refused, the old one runs on.
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert httpx.get(base + "/health").status_code == 503
        assert api.wait(timeout=200) == 0
        thread.join(timeout=10)
        assert result and result[0].status_code == 200, result
        assert result[0].json()["usage"]["completion_tokens"] == 300
        assert result[0].json()["choices"][0]["finish_reason"] == "length"
    finally:
        procs.stop()


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(server: Server) -> None:
    procs = Processes()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api = procs.start(api_argv(server.address, port, "--shutdown-timeout", "1"), "api-abort")
    try:
        wait_healthy(base, procs, timeout=60)
        body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 900, "ignore_eos": True}
        thread, result = post_in_thread(base, body)
        wait_load(base, 1)
        started = time.monotonic()
        api.send_signal(signal.SIGTERM)
        assert api.wait(timeout=60) == 0
        assert time.monotonic() - started < 30
        thread.join(timeout=10)
        assert result and result[0].status_code == 200, result
        assert result[0].json()["choices"][0]["finish_reason"] == "abort"
        # The engine freed the aborted request's blocks.
        deadline = time.monotonic() + 15
        while (stats := httpx.get(server.base_url + "/stats").json())["num_running"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        assert stats["num_used_blocks"] == 0
    finally:
        procs.stop()


def test_pagoda_serve_sigterm_drains_then_all_children_exit() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pagoda.frontend.pagoda_cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, *ENGINE_FLAGS, "--shutdown-timeout", "120"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        children = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        # Long enough (a few seconds) to be in flight when /load is polled and
        # when SIGTERM lands: 5 tokens could finish before the first poll.
        body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True}
        thread, result = post_in_thread(base, body)
        wait_load(base, 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=200) == 0
        thread.join(timeout=10)
        assert result and result[0].status_code == 200, result
        assert result[0].json()["usage"]["completion_tokens"] == 200
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie(int(pid))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True
