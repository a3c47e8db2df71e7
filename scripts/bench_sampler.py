"""The sampling kernels against greedy's argmax, per setting, on one batch of logits.

Times `pagoda.kernels.sampling.sample_rows` (compiled) at each setting next to the
compiled row argmax greedy uses, the plain-torch reference once, and the
penalty kernel, on random logits of the default model's shape:

    python scripts/bench_sampler.py                 # 64 x 49152
    python scripts/bench_sampler.py --rows 16 --spread 8

--spread scales the random logits (standard normal times it): a larger one
is a peakier distribution, a smaller one a flatter, longer nucleus.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

# name -> (temperature, top_k, top_p, min_p)
SETTINGS = {
    "defaults (temperature 1)": (1.0, 0, 1.0, 0.0),
    "temperature 0.8, top_p 0.95": (0.8, 0, 0.95, 0.0),
    "top_k 50": (1.0, 50, 1.0, 0.0),
    "min_p 0.05": (1.0, 0, 1.0, 0.05),
    "temperature 0.8, top_k 50, top_p 0.95": (0.8, 50, 0.95, 0.0),
    "top_p 0.5": (1.0, 0, 0.5, 0.0),
    "top_k 1000": (1.0, 1000, 1.0, 0.0),
}


def row_params(rows: int, t: float, k: int, p: float, m: float) -> tuple[torch.Tensor, ...]:
    """One setting for every row: temperature, top_k, top_p, min_p tensors."""
    return (
        torch.full((rows,), t),
        torch.full((rows,), k, dtype=torch.int64),
        torch.full((rows,), p),
        torch.full((rows,), m),
    )


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--spread", type=float, default=2.5)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    from pagoda.kernels import cpu_ops, sampling

    if cpu_ops.load_cpu_ops() is None:
        raise SystemExit("the compiled CPU kernels are not available here")
    rows, vocab = args.rows, args.vocab
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * args.spread
    seeds = torch.arange(rows, dtype=torch.int64)
    counters = torch.zeros(rows, dtype=torch.int64)
    print(f"{rows} x {vocab} logits, spread {args.spread}, {torch.get_num_threads()} threads")
    greedy = median_ms(lambda: cpu_ops.argmax_rows(logits), args.repeats)
    print(f"  {'greedy (compiled row argmax)':44s} {greedy:7.3f} ms")
    for name, setting in SETTINGS.items():
        params = row_params(rows, *setting)
        ms = median_ms(
            lambda params=params: sampling.sample_rows(logits, *params, seeds, counters),
            args.repeats,
        )
        print(f"  {name:44s} {ms:7.3f} ms  ({ms / greedy:.2f}x greedy)")
    params = row_params(rows, *SETTINGS["temperature 0.8, top_k 50, top_p 0.95"])
    ref = median_ms(
        lambda: sampling.sample_rows_reference(logits, *params, seeds, counters),
        max(3, args.repeats // 10),
    )
    print(f"  {'the torch reference, top_k 50 top_p 0.95':44s} {ref:7.3f} ms")

    # Penalties: each row with a 128-token prompt and 128 output tokens.
    history = torch.randint(0, vocab, (rows, 256), dtype=torch.int32)
    full = torch.full((rows,), 256, dtype=torch.int64)
    prompt = torch.full((rows,), 128, dtype=torch.int64)
    row_ids = torch.arange(rows, dtype=torch.int64)
    penalties = (torch.full((rows,), 1.1), torch.full((rows,), 0.5), torch.full((rows,), 0.5))
    work = logits.clone()
    ms = median_ms(
        lambda: sampling.apply_penalties(work, row_ids, history, row_ids, prompt, full, *penalties),
        args.repeats,
    )
    print(f"  {'penalties (256 tokens a row)':44s} {ms:7.3f} ms")


if __name__ == "__main__":
    main()
