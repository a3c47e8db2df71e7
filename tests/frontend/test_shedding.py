"""Load shedding: --max-waiting-requests, --max-inflight-requests, --max-queue-wait.

A flood of concurrent requests: the admitted ones complete in full, the
excess gets 503 with Retry-After at once, and the openai client's retries
recover every request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME
from tests.frontend.servers import Processes, api_argv, engine_argv, free_port, wait_healthy

pytestmark = pytest.mark.slow


@dataclass
class Shedding:
    # An API server with --max-inflight-requests 3: the engine's queue bound (3)
    # never refuses what it lets through.
    bounded: str
    unbounded: str  # an API server without a bound of its own


@pytest.fixture(scope="module")
def shedding(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shedding]:
    directory: Path = tmp_path_factory.mktemp("shed")
    address = f"ipc://{directory}/engine"
    procs = Processes()
    flags = (*ENGINE_FLAGS, "--max-num-seqs", "2", "--max-waiting-requests", "3")
    procs.start(engine_argv(address, *flags), "engine-shed")
    bounded, unbounded = free_port(), free_port()
    procs.start(api_argv(address, bounded, "--max-inflight-requests", "3"), "api-bounded")
    procs.start(api_argv(address, unbounded), "api-unbounded")
    try:
        for port in (bounded, unbounded):
            wait_healthy(f"http://127.0.0.1:{port}", procs)
        yield Shedding(f"http://127.0.0.1:{bounded}", f"http://127.0.0.1:{unbounded}")
    finally:
        procs.stop()


async def flood(base: str, n: int, max_tokens: int) -> list[httpx.Response]:
    body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=300) as client:
        return list(
            await asyncio.gather(
                *(client.post(base + "/v1/completions", json=body) for _ in range(n))
            )
        )


def check_split(responses: list[httpx.Response], max_tokens: int, needle: str) -> int:
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    for r in admitted:  # admitted requests run to the end
        assert r.json()["usage"]["completion_tokens"] == max_tokens
    for r in refused:
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert needle in r.json()["error"]["message"]
    return len(admitted)


def test_engine_queue_bound_refuses_the_excess(shedding: Shedding) -> None:
    responses = asyncio.run(flood(shedding.unbounded, 12, 6))
    admitted = check_split(responses, 6, "waiting")
    # At least the 3 the queue holds (more if some were scheduled meanwhile); not all 12.
    assert 3 <= admitted < 12, [r.status_code for r in responses]


def test_inflight_bound_refuses_the_excess_at_once(shedding: Shedding) -> None:
    started = time.monotonic()
    responses = asyncio.run(flood(shedding.bounded, 8, 6))
    assert check_split(responses, 6, "in flight") == 3
    assert time.monotonic() - started < 300
    assert httpx.get(shedding.bounded + "/load").json() == {"server_load": 0}


def test_openai_client_retries_recover(shedding: Shedding) -> None:
    async def run() -> list[str]:
        # Retry-After is 1 s: enough retries to outlast a slow, shared CPU.
        client = openai.AsyncOpenAI(base_url=shedding.bounded + "/v1", api_key="x", max_retries=120)
        outs = await asyncio.gather(
            *(
                client.completions.create(model=MODEL_NAME, prompt=f"{i} +", max_tokens=2)
                for i in range(6)
            )
        )
        return [o.choices[0].finish_reason for o in outs]

    reasons = asyncio.run(run())
    assert len(reasons) == 6 and all(r in ("length", "stop") for r in reasons)


def test_max_queue_wait_fails_requests_that_wait_too_long(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/engine"
    procs = Processes()
    flags = (*ENGINE_FLAGS, "--max-num-seqs", "1", "--max-queue-wait", "1")
    procs.start(engine_argv(address, *flags), "engine-qwait")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs.start(api_argv(address, port), "api-qwait")
    try:
        wait_healthy(base, procs)
        long = {
            "model": MODEL_NAME,
            "prompt": "Count:",
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", base + "/v1/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: dropping it would close the stream
            next(lines)  # the only sequence slot is taken now
            started = time.monotonic()
            body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4}
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            waited = time.monotonic() - started
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "waited more than 1 s" in r.json()["error"]["message"]
            assert 1.0 <= waited < 10
            chat = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": True,
            }
            r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60)
            assert r.status_code == 503, r.text
        # The slot is free again (the stream was closed, so aborted): requests run.
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        procs.stop()
