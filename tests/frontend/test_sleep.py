"""Sleep mode end to end: /sleep, /wake_up, /is_sleeping on real processes.

The engine process's RSS is read from /proc before and after each sleep
level and after waking; greedy output after waking must equal the output
before sleeping, token for token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from pagoda import AsyncLLM
from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME
from tests.frontend.servers import Processes, api_argv, engine_argv, free_port, wait_healthy

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def greedy(base: str) -> list[tuple[str, list[str], list[float]]]:
    out = []
    for prompt in PROMPTS:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "logprobs": 0,
        }
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lps = choice["logprobs"]
        out.append((choice["text"], lps["tokens"], lps["token_logprobs"]))
    return out


def test_sleep_frees_memory_and_wakes_identical(tmp_path: Path) -> None:
    procs = Processes()
    address = f"ipc://{tmp_path}/engine"
    port = free_port()
    flags = (*ENGINE_FLAGS, "--sleep-offload-dir", str(tmp_path))
    engine = procs.start(engine_argv(address, *flags), "engine-sleep")
    procs.start(api_argv(address, port), "api-sleep")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs)
        reference = greedy(base)
        awake = rss_bytes(engine.pid)
        assert httpx.get(base + "/is_sleeping").json() == {"is_sleeping": False}

        # Level 1: KV cache freed, weights parked in a spill file.
        r = httpx.post(base + "/sleep", params={"level": "1"}, timeout=120)
        assert r.status_code == 200, r.text
        asleep1 = rss_bytes(engine.pid)
        assert httpx.get(base + "/is_sleeping").json() == {"is_sleeping": True}
        # SmolLM2-135M in float32 is ~540 MB of weights.
        assert asleep1 < awake - 300 * MiB, (awake / MiB, asleep1 / MiB)

        # Requests while asleep: 503 + Retry-After, in each route's error shape.
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
        r = httpx.post(base + "/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "sleeping" in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/completions", json={**body, "stream": True})
        assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
        r = httpx.post(base + "/v1/chat/completions", json={**chat, "stream": True})
        assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/messages", json={**chat, "max_tokens": 4})
        assert r.status_code == 503 and r.json()["type"] == "error"
        assert httpx.get(base + "/health").status_code == 200  # asleep is not dead

        # Partial wake-up: still sleeping until the KV cache is back too.
        assert httpx.post(base + "/wake_up", params={"tags": "weights"}, timeout=120).is_success
        assert httpx.get(base + "/is_sleeping").json() == {"is_sleeping": True}
        assert httpx.post(base + "/wake-up", params={"tags": "kv_cache"}).is_success
        assert httpx.get(base + "/is_sleeping").json() == {"is_sleeping": False}
        woke1 = rss_bytes(engine.pid)
        assert woke1 > asleep1 + 300 * MiB
        assert greedy(base) == reference

        # Level 2: weights dropped, reloaded from the model file.
        assert httpx.post(base + "/sleep?level=2", timeout=120).status_code == 200
        asleep2 = rss_bytes(engine.pid)
        assert asleep2 < woke1 - 300 * MiB, (woke1 / MiB, asleep2 / MiB)
        assert httpx.post(base + "/wake_up", timeout=120).status_code == 200
        woke2 = rss_bytes(engine.pid)
        assert greedy(base) == reference
        print(
            f"engine RSS MiB: awake {awake / MiB:.0f}, level 1 {asleep1 / MiB:.0f}, "
            f"woken {woke1 / MiB:.0f}, level 2 {asleep2 / MiB:.0f}, woken {woke2 / MiB:.0f}"
        )

        # Bad input is a 400.
        assert httpx.post(base + "/sleep?level=3").status_code == 400
        r = httpx.post(base + "/wake_up?tags=gpu")
        assert r.status_code == 400 and "tags" in r.json()["error"]["message"]
    finally:
        assert procs.stop() == [0, 0], procs.tail()


def test_sleep_refused_while_requests_run_and_async_llm_controls(tmp_path: Path) -> None:
    procs = Processes()
    address = f"ipc://{tmp_path}/engine"
    port = free_port()
    procs.start(engine_argv(address, *ENGINE_FLAGS), "engine-sleep2")
    procs.start(api_argv(address, port), "api-sleep2")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs)
        body = {
            "model": MODEL_NAME,
            "prompt": "Count:",
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: dropping it would close the stream
            first = next(lines)  # generating now
            stats = httpx.get(base + "/stats").json()
            refused = httpx.post(base + "/sleep?level=1")
        assert "error" not in first and stats["num_running"] == 1, (first, stats)
        assert refused.status_code == 409, refused.text
        assert "in flight" in refused.json()["error"]["message"]

        async def sdk() -> None:
            engine = await AsyncLLM.connect(address)
            try:
                for _ in range(50):  # the disconnect above aborts the stream
                    if (await engine.get_stats())["num_running"] == 0:
                        break
                    await asyncio.sleep(0.1)
                assert not await engine.is_sleeping()
                await engine.sleep(1)
                assert await engine.is_sleeping()
                await engine.wake_up(["kv_cache", "weights"])
                assert not await engine.is_sleeping()
                assert await engine.reset_prefix_cache()
                for name in ("start_profile", "stop_profile"):
                    assert callable(getattr(engine, name))
            finally:
                await engine.client.close()

        asyncio.run(sdk())
        assert httpx.get(base + "/is_sleeping").json() == {"is_sleeping": False}
    finally:
        procs.stop()


def test_llm_sleep_and_wake_up() -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM(dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.sleep(level=1)
    assert llm.is_sleeping()
    with pytest.raises(ValueError, match="sleeping"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    llm.wake_up()
    after = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    for name in ("start_profile", "stop_profile", "reset_prefix_cache"):
        assert callable(getattr(llm, name))
