"""`pagoda serve --data-parallel-size 2 --enable-expert-parallel`: two engine
cores, each with half of every MoE layer's experts, stepping in lockstep.
Greedy tokens against transformers (float32) for requests on both engines at
once and for one alone (the other engine idles through the MoE layers); a
rank killed makes the other fail at once instead of waiting forever."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_core.helpers import random_prompts
from tests.engine_core.hf_reference import hf_greedy
from tests.engine_core.test_moe import VOCAB, build
from tests.frontend.servers import (
    child_pids,
    cmdline,
    free_port,
    is_gone,
    start_pagoda,
    wait_pagoda_healthy,
)
from tests.frontend.test_lora_sdk import add_word_tokenizer

pytestmark = pytest.mark.slow


def test_experts_over_two_engines_match_transformers(tmp_path: Path) -> None:
    path = build("qwen3_moe", tmp_path / "qwen3_moe")
    add_word_tokenizer(path, VOCAB)
    # Token ids below the tokenizer's <eos> (the last id) so that the text round-trips.
    prompts = [[t % (VOCAB - 1) for t in p] for p in random_prompts(21, 6, VOCAB, 4, 40)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = hf_greedy(hf, prompts, 8)
    assert len({tuple(t) for t in expected}) > 1
    port = free_port()
    flags = (
        "--model",
        str(path),
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        str(8 << 20),
        "--max-num-batched-tokens",
        "32",  # prompts are chunked: steps that sample nothing on one engine
        "--num-threads",
        "1",
    )
    pagoda = start_pagoda(port, flags, "--data-parallel-size", "2", "--enable-expert-parallel")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_pagoda_healthy(base, pagoda)
        # The engines share one host: the tokens go through shared memory.
        assert "holds experts (0, 4), exchange shm" in pagoda.output()
        assert "holds experts (4, 8), exchange shm" in pagoda.output()
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)

        async def complete(ids: list[int]) -> list[int]:
            out = await client.completions.create(
                model=str(path),
                prompt=ids,
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True, "skip_special_tokens": False},
            )
            return [VOCAB - 1 if w == "<eos>" else int(w[1:]) for w in out.choices[0].text.split()]

        async def together_then_alone() -> tuple[list[list[int]], list[list[int]]]:
            together = await asyncio.gather(*(complete(p) for p in prompts))
            # One at a time: each request on one engine while the other idles.
            alone = [await complete(p) for p in prompts[:2]]
            return list(together), alone

        together, alone = asyncio.run(together_then_alone())
        assert together == expected
        assert alone == expected[:2]
        stats = httpx.get(base + "/stats", timeout=30).json()
        assert all(n >= 1 for n in stats["num_routed"]), stats["num_routed"]

        # Logprobs: transformers' log-softmax at each chosen token, within 1e-4.
        body = {
            "prompt": prompts[2],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
        }
        got = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        token_logprobs = got["choices"][0]["logprobs"]["token_logprobs"]
        with torch.no_grad():
            ids = torch.tensor([prompts[2] + expected[2]])
            logits = hf(ids).logits[0, len(prompts[2]) - 1 : -1].float()
        want_lp = torch.log_softmax(logits, -1)[torch.arange(8), torch.tensor(expected[2])]
        assert max(abs(a - b) for a, b in zip(token_logprobs, want_lp.tolist(), strict=True)) < 1e-4
        # Seeds: the same sampled tokens whichever engine takes the request.
        body = {"prompt": prompts[3], "max_tokens": 8, "temperature": 1.0, "seed": 7}
        texts = {
            httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            for _ in range(4)
        }
        assert len(texts) == 1

        # Kill one engine: the other's next exchange fails, it says why and exits.
        engines = [
            p for p in child_pids(pagoda.proc.pid) if "engine-core-1" in " ".join(cmdline(p))
        ]
        assert len(engines) == 1
        os.kill(engines[0], signal.SIGKILL)
        pagoda.proc.wait(timeout=60)
        assert pagoda.proc.returncode != 0
        deadline = time.monotonic() + 10
        while "an expert-parallel engine failed" not in pagoda.output():
            assert time.monotonic() < deadline, pagoda.output()[-3000:]
            time.sleep(0.2)
    finally:
        if pagoda.proc.poll() is None:
            os.killpg(pagoda.proc.pid, signal.SIGKILL)
            pagoda.proc.wait()


def test_scale_engines_that_split_the_experts_while_requests_run(tmp_path: Path) -> None:
    """--enable-elastic-ep with --enable-expert-parallel: 1 → 2 → 1 engines while
    a client keeps requests in flight. Each scale starts a new generation of
    engines (a new expert-parallel world) beside the old; every request
    completes with transformers' tokens or is refused with 503 + Retry-After;
    the old generation's processes are gone after each scale."""
    path = build("qwen3_moe", tmp_path / "qwen3_moe")
    add_word_tokenizer(path, VOCAB)
    prompts = [[t % (VOCAB - 1) for t in p] for p in random_prompts(5, 4, VOCAB, 4, 24)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = hf_greedy(hf, prompts, 6)
    port = free_port()
    flags = ("--model", str(path), "--dtype", "float32", "--kv-cache-memory-bytes", str(8 << 20))
    pagoda = start_pagoda(
        port,
        flags,
        "--enable-expert-parallel",
        "--enable-elastic-ep",
        "--admin-api-key",
        "k",
        "--num-threads",
        "1",
    )
    base = f"http://127.0.0.1:{port}"
    outcomes: list[tuple[int, int, list[int] | None, str | None]] = []
    stop = threading.Event()

    def engines() -> list[str]:
        names = [" ".join(cmdline(p)) for p in child_pids(pagoda.proc.pid) if not is_gone(p)]
        return [n for n in names if "engine-core" in n]

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            body = {
                "prompt": prompts[i % len(prompts)],
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "skip_special_tokens": False,
            }
            r = httpx.post(base + "/v1/completions", json=body, timeout=120)
            tokens = None
            if r.status_code == 200:
                words = r.json()["choices"][0]["text"].split()
                tokens = [VOCAB - 1 if w == "<eos>" else int(w[1:]) for w in words]
            outcomes.append((i % len(prompts), r.status_code, tokens, r.headers.get("retry-after")))
            if r.status_code == 503:
                time.sleep(0.2)
            i += 1

    def scale(size: int) -> httpx.Response:
        return httpx.post(
            base + "/scale_elastic_ep",
            json={"new_data_parallel_size": size, "drain_timeout": 60},
            headers={"Authorization": "Bearer k"},
            timeout=300,
        )

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    try:
        wait_pagoda_healthy(base, pagoda)
        for t in threads:
            t.start()
        time.sleep(1)
        started = time.monotonic()
        up = scale(2)
        up_s = time.monotonic() - started
        assert up.status_code == 200, up.text
        assert up.json()["new_data_parallel_size"] == 2
        assert "holds experts (4, 8), exchange shm" in pagoda.output()
        running = engines()
        assert len(running) == 2 and all("--data-parallel-size 2" in n for n in running)
        time.sleep(1)
        started = time.monotonic()
        down = scale(1)
        down_s = time.monotonic() - started
        assert down.status_code == 200, down.text
        print(f"scale 1 -> 2: {up_s:.1f} s; 2 -> 1: {down_s:.1f} s; {len(outcomes)} requests")
        running = engines()
        assert len(running) == 1 and "--data-parallel-size" not in running[0]
        time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
        if pagoda.proc.poll() is None:
            os.killpg(pagoda.proc.pid, signal.SIGTERM)
            try:
                pagoda.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(pagoda.proc.pid, signal.SIGKILL)
    assert not any(t.is_alive() for t in threads), "a request hung"
    served = [o for o in outcomes if o[1] == 200]
    assert served, "no request was served"
    for index, status, tokens, retry_after in outcomes:
        if status == 200:
            assert tokens == expected[index]
        else:
            assert status == 503 and retry_after is not None, (status, tokens)
