"""bf16 against `--quantization int8`, end to end, best of alternated rounds.

    python scripts/bench_int8_steps.py [--rounds 4]

For a machine shared with other work, where one long run of
scripts/bench_throughput.py per configuration says more about the
neighbours than about Pagoda: both engines live in this process (default
model, bfloat16, 4096-token steps, 1 GiB of KV each) and take turns, each
round on fresh random prompts (no prefix-cache hits), and each figure is the
best over the rounds:

- prefill: 64 prompts of 128 tokens to their first token, ms;
- batch 64: 64 such prompts to 32 tokens each; the best such run less the
  best prefill, per decode step, ms;
- batch 1: one 128-token prompt to 33 tokens, ms per output token (prefill
  included).
"""

from __future__ import annotations

import argparse
import random
import time

from pagoda import LLM, SamplingParams


def timed_s(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(0)
    llms = {
        name: LLM(
            None,
            dtype="bfloat16",
            quantization=quantization,
            max_num_batched_tokens=4096,
            kv_cache_memory_bytes=1 << 30,
        )
        for name, quantization in (("bf16", None), ("int8", "int8"))
    }
    best = {name: {"prefill": 1e9, "batch64": 1e9, "batch1": 1e9} for name in llms}
    for llm in llms.values():
        timed_s(llm, [[rng.randrange(100, 49152) for _ in range(16)]], 4)  # warm up
    for _ in range(args.rounds):
        for name, llm in llms.items():

            def fresh(n: int) -> list[list[int]]:
                return [[rng.randrange(100, 49152) for _ in range(128)] for _ in range(n)]

            b = best[name]
            b["prefill"] = min(b["prefill"], timed_s(llm, fresh(64), 1))
            b["batch64"] = min(b["batch64"], timed_s(llm, fresh(64), 32))
            b["batch1"] = min(b["batch1"], timed_s(llm, fresh(1), 33))
    print(f"best of {args.rounds} alternated rounds, ms")
    print(f"{'':>6} {'prefill 64x128':>15} {'batch-64 step':>14} {'batch-1 per token':>18}")
    for name, b in best.items():
        step = (b["batch64"] - b["prefill"]) / 31 * 1e3
        print(f"{name:>6} {b['prefill'] * 1e3:15.0f} {step:14.1f} {b['batch1'] / 33 * 1e3:18.1f}")


if __name__ == "__main__":
    main()
