"""Worker processes under `pagoda serve`: titles, and a killed worker ends
the server with an error naming its rank instead of a hang."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME, Server
from tests.frontend.servers import (
    child_pids,
    cmdline,
    free_port,
    is_gone,
    start_pagoda,
    wait_pagoda_healthy,
)

pytestmark = pytest.mark.slow


def test_killed_worker_fails_requests_and_stops_pagoda_naming_the_rank() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pagoda = start_pagoda(port, ENGINE_FLAGS, "--distributed-executor-backend", "mp")
    proc = pagoda.proc
    try:
        wait_pagoda_healthy(base, pagoda)
        engine = next(p for p in child_pids(proc.pid) if cmdline(p)[0] == "pagoda::engine-core")
        workers = [p for p in child_pids(engine) if cmdline(p)[0] == "pagoda::worker-0"]
        assert len(workers) == 1
        seen: list[str] = []
        ended = threading.Event()

        def stream() -> None:
            body = {
                "model": MODEL_NAME,
                "prompt": "Once upon a time",
                "max_tokens": 1000,
                "ignore_eos": True,
                "stream": True,
            }
            try:
                with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        seen.append(line)
            except httpx.HTTPError as e:
                seen.append(f"transport error: {e}")
            ended.set()

        threading.Thread(target=stream, daemon=True).start()
        deadline = time.monotonic() + 60
        while sum(line.startswith("data: {") for line in seen) < 3:
            assert time.monotonic() < deadline, seen[-5:]
            time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        assert ended.wait(15), "the stream did not end after its worker died"
        assert time.monotonic() - killed_at < 10
        # The stream ends with an error event that names the rank, then [DONE].
        errors = [line for line in seen if line.startswith('data: {"error"')]
        assert len(errors) == 1, seen[-6:]
        assert "worker rank 0" in errors[0] and "service_unavailable_error" in errors[0]
        assert proc.wait(timeout=30) != 0
        output = pagoda.output()
        assert "worker rank 0" in output and "exited with code -9" in output, output[-3000:]
        assert is_gone(engine)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_pipeline_stages_serve_what_one_rank_serves(server: Server) -> None:
    """`pagoda serve --pipeline-parallel-size 2`: two worker processes, each
    with half of the default model's layers; over HTTP, greedy completions
    and a streamed chat answer as the single-process engine does, and
    concurrent requests (split over the stages' plans) all complete."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pagoda = start_pagoda(port, ENGINE_FLAGS, "--pipeline-parallel-size", "2")
    proc = pagoda.proc
    try:
        wait_pagoda_healthy(base, pagoda)
        engine = next(p for p in child_pids(proc.pid) if cmdline(p)[0] == "pagoda::engine-core")
        titles = sorted(cmdline(p)[0] for p in child_pids(engine))
        assert [t for t in titles if t.startswith("pagoda::worker")] == [
            "pagoda::worker-0",
            "pagoda::worker-1",
        ]
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        for prompt in prompts:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0}
            want = httpx.post(server.v1 + "/completions", json=body, timeout=60).json()
            got = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
            assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt
        chat = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 20,
            "temperature": 0,
        }
        want_text = httpx.post(server.v1 + "/chat/completions", json=chat, timeout=60).json()
        pieces = []
        with httpx.stream(
            "POST", base + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        pieces.append(choice["delta"].get("content") or "")
        assert "".join(pieces) == want_text["choices"][0]["message"]["content"]
        results: list[dict[str, object]] = []

        def complete(i: int) -> None:
            body = {
                "model": MODEL_NAME,
                "prompt": f"Story number {i}:",
                "max_tokens": 16,
                "ignore_eos": True,
                "temperature": 0.8,
                "seed": i,
            }
            results.append(httpx.post(base + "/v1/completions", json=body, timeout=120).json())

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert len(results) == 6
        assert all(r["usage"]["completion_tokens"] == 16 for r in results), results  # type: ignore[index]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except Exception:  # noqa: BLE001 - then hard
                os.killpg(proc.pid, signal.SIGKILL)
