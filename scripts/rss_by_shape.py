"""Engine RSS against new batch shapes: an in-process EngineCore, no HTTP.

    python scripts/rss_by_shape.py             # each round brings new token counts
    python scripts/rss_by_shape.py --same      # every round repeats the same shapes
    python scripts/rss_by_shape.py --trim      # malloc_trim(0) after each round

Each round runs 5 batches of 16 requests (prompts of 8-400 random tokens,
4-32 new tokens, 30% aborted after 3 steps) and prints the RSS, the growth
since warm-up, and the requests the scheduler and the runner still hold.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagoda.engine_core.config import EngineConfig  # noqa: E402
from pagoda.engine_core.core.engine import EngineCore  # noqa: E402
from pagoda.protocol.messages import AddRequest  # noqa: E402
from pagoda.protocol.sampling_params import SamplingParams  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--same", action="store_true", help="repeat the same shapes each round")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after each round")
    args = parser.parse_args()
    engine = EngineCore(
        EngineConfig(dtype="bfloat16", kv_cache_memory_bytes=256 << 20, max_model_len=1024)
    )
    shapes, tokens = random.Random(0), random.Random(1)
    count = 0

    def batch() -> None:
        nonlocal count
        ids = []
        for _ in range(16):
            count += 1
            length = shapes.choice((8, 30, 120, 400))
            params = SamplingParams(temperature=0.8, max_tokens=shapes.choice((4, 8, 16, 32)))
            prompt = [tokens.randrange(100, 40000) for _ in range(length)]
            engine.add_request(AddRequest(f"r{count}", prompt, params, time.time()))
            ids.append(f"r{count}")
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
            if steps == 3:
                engine.abort_requests([i for i in ids if shapes.random() < 0.3])

    for _ in range(3):
        batch()
    base = rss_mib()
    for _ in range(args.rounds):
        if args.same:
            shapes.seed(0)
        for _ in range(5):
            batch()
        gc.collect()
        if args.trim:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        now = rss_mib()
        runner = engine.executor.worker.runner
        held = len(engine.scheduler.requests), len(getattr(runner, "requests", {}))
        print(f"requests {count:5d}  rss {now:6.0f} MiB ({now - base:+.0f})  held {held}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
