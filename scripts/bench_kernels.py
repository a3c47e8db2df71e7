"""CPU kernel benchmark: compiled paged decode attention vs the torch path.

    python scripts/bench_kernels.py

Prints the relative error against the torch path and the time per call for a
decode batch of 64 sequences of 100-256 tokens (SmolLM2's head layout).
"""

from __future__ import annotations

import functools
import time

import torch

from pagoda.engine_core.attention.cpu_backend import decode_attention
from pagoda.kernels.cpu_ops import load_cpu_ops, paged_decode_attention


def timed(fn: object, n: int = 20) -> float:
    fn()  # type: ignore[operator]
    start = time.perf_counter()
    for _ in range(n):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - start) / n * 1000


def main() -> None:
    start = time.perf_counter()
    ops = load_cpu_ops()
    print(
        f"kernel build/load: {time.perf_counter() - start:.1f} s ({'ok' if ops else 'unavailable'})"
    )
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim, block_size, num_blocks = 64, 9, 3, 64, 16, 2000
    for dtype in (torch.float32, torch.bfloat16):
        k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
        v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
        lens = torch.randint(100, 257, (batch,))
        tables = torch.randperm(num_blocks)[: batch * 17].view(batch, 17)
        q = torch.randn(batch, heads, head_dim).to(dtype)
        max_len = int(lens.max())
        ref = decode_attention(q, k_cache, v_cache, tables, lens, max_len, 0.125)
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        args = (q, k_cache, v_cache, tables, lens)
        t_torch = timed(functools.partial(decode_attention, *args, max_len, 0.125))
        t_kernel = timed(functools.partial(paged_decode_attention, *args, 0.125))
        print(
            f"{str(dtype):>15}: rel err {err:.1e}  torch {t_torch:.2f} ms  "
            f"kernel {t_kernel:.2f} ms ({t_torch / t_kernel:.1f}x)"
        )


if __name__ == "__main__":
    main()
