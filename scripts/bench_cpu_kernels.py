"""Microbenchmark of the compiled CPU elementwise kernels against plain torch.

    python scripts/bench_cpu_kernels.py

Prints microseconds per call for fused add+RMSNorm (hidden 576) and
SiLU-and-mul (intermediate 1536), the default model's sizes, at decode (64
rows) and prefill (4096 rows) sizes, in bfloat16 and float32.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu_ops


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    summed = residual + x
    xf = summed.float()
    _ = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def bench_size(dtype: torch.dtype, rows: int) -> None:
    calls = 20 if rows > 64 else 200
    x = torch.randn(rows, 576).to(dtype)
    residual = torch.randn(rows, 576).to(dtype)
    weight = torch.rand(576).to(dtype)
    gate_up = torch.randn(rows, 2 * 1536).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    cases = {
        "add_rms_norm": (
            lambda: cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-5),
            lambda: torch_add_rms_norm(x, residual, weight),
        ),
        "silu_and_mul": (lambda: cpu_ops.silu_and_mul(gate_up), lambda: F.silu(gate) * up),
    }
    for name, (compiled, plain) in cases.items():
        print(
            f"{str(dtype).split('.')[-1]:>9} {rows:>5} {name:>13} "
            f"{per_call_us(compiled, calls):>12.1f} {per_call_us(plain, calls):>9.1f}"
        )


def main() -> None:
    if cpu_ops.load_cpu_ops() is None:
        raise SystemExit("the compiled CPU kernels are not available here")
    print(f"{'dtype':>9} {'rows':>5} {'op':>13} {'compiled us':>12} {'torch us':>9}")
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (64, 4096):
            bench_size(dtype, rows)


if __name__ == "__main__":
    main()
