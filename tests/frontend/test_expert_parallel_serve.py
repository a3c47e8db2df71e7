"""`pagoda serve --data-parallel-size 2 --enable-expert-parallel`: two engine
cores, each with half of every MoE layer's experts, stepping in lockstep.
Greedy tokens against transformers (float32) for requests on both engines at
once and for one alone (the other engine idles through the MoE layers); a
rank killed makes the other fail at once instead of waiting forever."""

from __future__ import annotations

import asyncio
import os
import signal
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
from tests.frontend.servers import child_pids, cmdline, free_port, start_pagoda, wait_pagoda_healthy
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
