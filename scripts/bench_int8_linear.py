"""The int8 linear (`--quantization int8`) against the bfloat16 one.

    python scripts/bench_int8_linear.py [--layers 30] [--rounds 5] [--threads N]

The default model's projections (qkv 576->960, o 576->576, gate|up
576->3072, down 1536->576), each layer's weights its own so that they come
from memory as in the model, at decode (1 to 64 rows) and prefill (512 rows)
sizes: milliseconds for one pass over all layers of

- bf16: kernels/linear.Linear on bfloat16 weights (the pairs kernel on
  AVX512-BF16 without AMX), what the bfloat16 model runs;
- int8: kernels/linear_int8 (activations quantized per token and group of
  64 inputs, VNNI int32 sums, the scaling, in one call), what
  `--quantization int8` runs;
- int_mm: torch's nearest offer: activations quantized per token (one scale
  a row, less work than the groups) in torch ops, `torch._int_mm` (which
  needs more than 16 rows), then the scaling.

Alternated, the best of the rounds each (the machine may be shared).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from pagoda.kernels.linear import Linear
from pagoda.kernels.linear_int8 import (
    Int8Weight,
    pack_int8,
    quantize_int8_activations,
    quantize_int8_per_channel,
)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
ROWS = [1, 2, 4, 8, 16, 32, 64, 512]


def timed_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def int_mm_linear(x: torch.Tensor, q_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q_x, s_x = quantize_int8_activations(x, group=x.shape[1])  # one scale per row
    sums = torch._int_mm(q_x, q_t)  # [rows, out] int32
    return (sums.float() * s_x * scale[None, :]).to(x.dtype)


def run_bf16(linears: list[Linear], xs: dict[int, torch.Tensor]) -> None:
    for lin in linears:
        lin(xs[lin.in_features])


def run_int8(weights: list[Int8Weight], xs: dict[int, torch.Tensor]) -> None:
    for w in weights:
        w.matmul(xs[w.packed.shape[1] * 4], None)


def run_int_mm(
    weights: list[tuple[torch.Tensor, torch.Tensor]], xs: dict[int, torch.Tensor]
) -> None:
    for q_t, scale in weights:
        int_mm_linear(xs[q_t.shape[0]], q_t, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bf16: list[Linear] = []
    int8: list[Int8Weight] = []
    int_mm: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(args.layers):
        for out, inp in SHAPES:
            w = torch.randn(out, inp) * inp**-0.5
            bf16.append(Linear(w.bfloat16()))
            q, s = quantize_int8_per_channel(w)
            int8.append(pack_int8(q, s))
            int_mm.append((q.t(), s))
    print(f"{args.layers} layers x 4 projections, ms per pass (best of {args.rounds})")
    print(f"{'rows':>5} {'bf16':>8} {'int8':>8} {'int_mm':>8} {'bf16/int8':>10}")
    for rows in ROWS:
        xs = {inp: torch.randn(rows, inp).bfloat16() for inp in (576, 1536)}
        runs: dict[str, Callable[[], object]] = {
            "bf16": partial(run_bf16, bf16, xs),
            "int8": partial(run_int8, int8, xs),
        }
        if rows > 16:
            runs["int_mm"] = partial(run_int_mm, int_mm, xs)
        best = {name: float("inf") for name in runs}
        for fn in runs.values():
            fn()  # warm up
        for _ in range(args.rounds):
            for name, fn in runs.items():
                best[name] = min(best[name], timed_ms(fn))
        mm = f"{best['int_mm']:8.2f}" if "int_mm" in best else f"{'-':>8}"
        ratio = best["bf16"] / best["int8"]
        print(f"{rows:>5} {best['bf16']:8.2f} {best['int8']:8.2f} {mm} {ratio:9.2f}x")


if __name__ == "__main__":
    main()
