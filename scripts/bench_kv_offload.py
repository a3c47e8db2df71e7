"""Time to first token of a long prompt asked again after it was evicted from
the KV cache: recomputed, or brought back from the host tier
(--kv-transfer-config OffloadingConnector).

    python scripts/bench_kv_offload.py [--prompt-len 1024] [--rounds 3]

The KV cache holds a little more than one prompt, so a second prompt evicts
the first; the host tier holds several. Default model, bfloat16.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.model_config import load_model_config, resolve_model_path
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams


def ttft(engine: EngineCore, request_id: str, prompt: list[int]) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=1)
    started = time.perf_counter()
    assert engine.add_request(AddRequest(request_id, prompt, params, 0.0)) is None
    cached = 0
    while engine.has_work():
        for _, delta in engine.step():
            cached = max(cached, delta.num_cached_tokens)
    return time.perf_counter() - started, cached


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    mc = load_model_config(resolve_model_path(None))
    block_bytes = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 2
    blocks = args.prompt_len // 16 + 16
    rng = random.Random(0)
    results: dict[str, list[float]] = {}
    for label, tier in (("recomputed", None), ("host tier", 4 * blocks * block_bytes)):
        extra = {}
        if tier:
            extra["kv_transfer_config"] = json.dumps(
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_connector_extra_config": {"cpu_bytes": tier},
                }
            )
        engine = EngineCore(
            EngineConfig(dtype="bfloat16", kv_cache_memory_bytes=blocks * block_bytes, **extra)  # type: ignore[arg-type]
        )
        times = []
        for r in range(args.rounds):
            a = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
            b = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
            ttft(engine, f"a{r}", a)
            ttft(engine, f"b{r}", b)  # evicts a's blocks
            seconds, cached = ttft(engine, f"a{r}-again", a)
            times.append(seconds)
            print(f"{label}: TTFT {seconds * 1e3:.0f} ms, {cached} cached tokens")
        results[label] = times
        engine.shutdown()
    for label, times in results.items():
        print(f"{label:>11}: median TTFT {statistics.median(times) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
