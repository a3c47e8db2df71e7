"""Elastic data parallelism (`pagoda serve --enable-elastic-ep`, POST
/scale_elastic_ep): engines added and retired while a client keeps requests
in flight; every request completes with the right text or is refused with
503 + Retry-After before it started; errors and a rank killed mid-scale
leave the old size serving and the scaling flag clear."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.frontend.conftest import ENGINE_FLAGS
from tests.frontend.servers import (
    Pagoda,
    child_pids,
    cmdline,
    free_port,
    is_gone,
    start_pagoda,
    wait_pagoda_healthy,
)

ADMIN_KEY = "elastic-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPTS = [f"Count from {i} to {i + 5}:" for i in range(8)]


@dataclass
class Elastic:
    base: str
    pagoda: Pagoda
    references: list[str] = field(default_factory=list)

    def engines(self) -> list[int]:
        """The engine-core processes `pagoda serve` runs now."""
        return [
            pid
            for pid in child_pids(self.pagoda.proc.pid)
            if not is_gone(pid) and "engine-core" in " ".join(cmdline(pid))
        ]

    def scale(self, size: int, drain_timeout: float = 60, key: bool = True) -> httpx.Response:
        return httpx.post(
            f"{self.base}/scale_elastic_ep",
            json={"new_data_parallel_size": size, "drain_timeout": drain_timeout},
            headers=ADMIN if key else {},
            timeout=300,
        )

    def scaling(self) -> bool:
        return bool(
            httpx.get(f"{self.base}/is_scaling_elastic_ep", timeout=10).json()[
                "is_scaling_elastic_ep"
            ]
        )


def complete(base: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def elastic() -> Iterator[Elastic]:
    port = free_port()
    pagoda = start_pagoda(port, ENGINE_FLAGS, "--enable-elastic-ep", "--admin-api-key", ADMIN_KEY)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_pagoda_healthy(base, pagoda)
        references = [complete(base, p).json()["choices"][0]["text"] for p in PROMPTS]
        yield Elastic(base, pagoda, references)
    finally:
        pagoda.proc.send_signal(signal.SIGTERM)
        try:
            pagoda.proc.wait(timeout=40)
        except Exception:  # noqa: BLE001
            os.killpg(pagoda.proc.pid, signal.SIGKILL)


def test_scale_up_and_down_while_requests_are_in_flight(elastic: Elastic) -> None:
    outcomes: list[tuple[int, int, str, str | None]] = []
    stop = threading.Event()

    def client(index: int) -> None:
        i = index
        while not stop.is_set():
            r = complete(elastic.base, PROMPTS[i % len(PROMPTS)])
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
            outcomes.append((i % len(PROMPTS), r.status_code, text, r.headers.get("retry-after")))
            if r.status_code == 503:
                time.sleep(0.2)  # the client backs off, as Retry-After asks
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        started = time.monotonic()
        first: list[httpx.Response] = []
        runner = threading.Thread(target=lambda: first.append(elastic.scale(2)))
        runner.start()
        deadline = time.monotonic() + 30
        while not elastic.scaling():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # A second scale while one runs: 409; /health and /load answer meanwhile.
        assert elastic.scale(3).status_code == 409
        # (/health pings the engines within 2 s: on a machine this busy it may
        # say they are slow, but never that the server is scaling.)
        health = httpx.get(f"{elastic.base}/health", timeout=10)
        assert health.status_code == 200 or "scaling" not in health.text
        assert httpx.get(f"{elastic.base}/load", timeout=10).status_code == 200
        runner.join(timeout=300)
        up_s = time.monotonic() - started
        assert first and first[0].status_code == 200, first
        assert first[0].json() == {
            "message": "Scaled to 2 data parallel engines",
            "new_data_parallel_size": 2,
        }
        assert len(elastic.engines()) == 2
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    # Requests still running on the engine to retire past the drain timeout: 408.
    release = threading.Event()
    streaming = threading.Semaphore(0)

    def long_request(prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{elastic.base}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()  # kept: a dropped iterator would close the stream
            next(lines)
            streaming.release()
            release.wait(120)  # then the connection closes: the server aborts it

    long = [threading.Thread(target=long_request, args=(p,)) for p in PROMPTS[:3]]
    for t in long:
        t.start()
    for _ in long:
        assert streaming.acquire(timeout=120)
    r = elastic.scale(1, drain_timeout=0.3)
    stats = httpx.get(f"{elastic.base}/stats", timeout=10).json()
    assert r.status_code == 408, (r.text, stats)
    assert not elastic.scaling() and len(elastic.engines()) == 2
    assert complete(elastic.base, PROMPTS[1]).json()["choices"][0]["text"] == elastic.references[1]
    release.set()
    for t in long:
        t.join(timeout=60)
    started = time.monotonic()
    down = elastic.scale(1)
    down_s = time.monotonic() - started
    assert down.status_code == 200, down.text
    print(f"scale 1 -> 2: {up_s:.1f} s; 2 -> 1: {down_s:.1f} s; {len(outcomes)} requests")
    served = [o for o in outcomes if o[1] == 200]
    assert served, "no request was served"
    for index, status, text, retry_after in outcomes:
        if status == 200:
            assert text == elastic.references[index]
        else:
            assert status == 503 and retry_after is not None, (status, text)
    stats = httpx.get(f"{elastic.base}/stats", timeout=10).json()
    assert stats["num_used_blocks"] == 0 and len(stats["engines"]) == 1
    assert len(elastic.engines()) == 1
    assert not elastic.scaling()


def test_scale_errors_in_the_api_shape(elastic: Elastic) -> None:
    assert elastic.scale(2, key=False).status_code == 401
    bad: list[dict[str, object]] = [
        {},
        {"new_data_parallel_size": True},
        {"new_data_parallel_size": 0},
        {"new_data_parallel_size": 1.5},
        {"new_data_parallel_size": 2, "drain_timeout": 0},
    ]
    for body in bad:
        r = httpx.post(f"{elastic.base}/scale_elastic_ep", json=body, headers=ADMIN, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = elastic.scale(1)
    assert r.status_code == 400 and "already serving 1" in r.json()["error"]["message"]
    assert httpx.post(f"{elastic.base}/is_scaling_elastic_ep", timeout=10).json() == {
        "is_scaling_elastic_ep": False
    }


def test_a_rank_killed_mid_scale_leaves_the_old_size_serving(elastic: Elastic) -> None:
    before = set(elastic.engines())
    result: list[httpx.Response] = []
    runner = threading.Thread(target=lambda: result.append(elastic.scale(2)))
    runner.start()
    deadline = time.monotonic() + 60
    while not (new := set(elastic.engines()) - before):
        assert time.monotonic() < deadline, "no new engine process"
        time.sleep(0.05)
    for pid in new:
        os.kill(pid, signal.SIGKILL)
    runner.join(timeout=300)
    assert result and result[0].status_code == 500, result
    assert "died" in result[0].json()["error"]["message"]
    assert not elastic.scaling()
    assert set(elastic.engines()) == before
    r = complete(elastic.base, PROMPTS[2])
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == elastic.references[2]
    assert elastic.pagoda.proc.poll() is None  # the server lives on


def test_without_the_flag_the_routes_are_not_there(server) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(f"{server.base_url}/scale_elastic_ep", json={"new_data_parallel_size": 2})
    assert r.status_code == 404
