"""Process topology: several API servers per engine, pagoda serve supervision, AsyncLLM."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest

from pagoda import AsyncLLM, SamplingParams
from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME, Server
from tests.frontend.servers import (
    Processes,
    api_argv,
    child_pids,
    cmdline,
    free_port,
    is_gone,
    start_pagoda,
    wait_healthy,
    wait_pagoda_healthy,
)

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of Italy is", "def fibonacci(n):", "Three colours are", "Water boils at"]


def test_http_greedy_equals_offline_llm(server: Server) -> None:
    from pagoda import LLM

    c = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    http_texts = [
        c.completions.create(model=MODEL_NAME, prompt=p, temperature=0, max_tokens=24)
        .choices[0]
        .text
        for p in PROMPTS
    ]
    llm = LLM(dtype="float32", kv_cache_memory_bytes=128 << 20, max_model_len=1024)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == http_texts


def test_second_api_server_attaches_to_running_engine(server: Server) -> None:
    procs = Processes()
    port = free_port()
    procs.start(api_argv(server.address, port), "api2")
    try:
        base2 = f"http://127.0.0.1:{port}"
        wait_healthy(base2, procs, timeout=60)

        async def ask(base: str, i: int) -> str:
            c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            r = await c.completions.create(
                model=MODEL_NAME, prompt=PROMPTS[i % 4], temperature=0, max_tokens=12
            )
            return r.choices[0].text

        async def both() -> tuple[list[str], list[str]]:
            a = asyncio.gather(*(ask(server.base_url, i) for i in range(8)))
            b = asyncio.gather(*(ask(base2, i) for i in range(8)))
            return await asyncio.gather(a, b)  # type: ignore[return-value]

        from_first, from_second = asyncio.run(both())
        # Each server got exactly its own outputs: same prompts, same greedy texts.
        assert from_first == from_second
        assert len(set(from_first)) == 4
    finally:
        assert procs.stop() == [0]


def test_pagoda_serve_two_api_servers_and_sigterm_stops_all() -> None:
    port = free_port()
    pagoda = start_pagoda(port, ENGINE_FLAGS, "--api-server-count", "2")
    proc = pagoda.proc
    try:
        wait_pagoda_healthy(f"http://127.0.0.1:{port}", pagoda)
        children = child_pids(proc.pid)
        assert len(children) == 3  # one engine core, two API servers
        # ps and top tell them apart by their process titles.
        titles = sorted(cmdline(pid)[0] for pid in children)
        assert titles == ["pagoda::api-server-0", "pagoda::api-server-1", "pagoda::engine-core"]
        engine = next(pid for pid in children if cmdline(pid)[0] == "pagoda::engine-core")
        assert "--address" in cmdline(engine)  # its flags follow the title
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        generated = 0
        for _ in range(3):  # connections spread over both API servers
            for p in PROMPTS:
                out = c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4)
                assert out.choices[0].text and out.usage is not None
                generated += out.usage.completion_tokens
        # /metrics sums the request metrics of both API server processes.
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total"))
        assert float(line.rsplit(" ", 1)[1]) == generated
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        for pid in children:
            assert is_gone(pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_async_llm_streams_and_aborts(server: Server) -> None:
    async def run() -> None:
        engine = await AsyncLLM.connect(server.address)
        try:
            pieces = []
            async for out in engine.generate(
                "Once upon a time", SamplingParams(temperature=0, max_tokens=10), "a-1"
            ):
                pieces.append(out.outputs[0].text)
                last = out
            assert last.finished and len(pieces) >= 2
            assert last.outputs[0].finish_reason in ("length", "stop")

            params = SamplingParams(max_tokens=500, ignore_eos=True)
            gen = engine.generate("Count:", params, "a-2")
            await anext(gen)
            await engine.abort("a-2")
            outs = [o async for o in gen]
            assert outs[-1].outputs[0].finish_reason == "abort"
            for _ in range(50):
                stats = await engine.get_stats()
                if stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.1)
            assert stats["num_running"] == 0
        finally:
            await engine.client.close()

    asyncio.run(run())


def test_async_llm_from_engine_args_starts_and_stops_its_engine() -> None:
    async def run() -> None:
        engine = await AsyncLLM.from_engine_args(
            dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512
        )
        process = engine._engine_process
        assert process is not None and process.poll() is None
        outs = [
            o
            async for o in engine.generate(
                [1, 504, 3575, 282, 4649, 314], SamplingParams(temperature=0, max_tokens=3), "x"
            )
        ]
        assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 3
        await engine.shutdown()
        assert process.poll() is not None

    asyncio.run(run())
