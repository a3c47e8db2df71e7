"""Batched LoRA benchmark: the grouped launcher vs the per-token gather reference.

    python scripts/bench_lora.py

SmolLM2-135M's q|k|v projection (576 → 960) with rank-16 adapters stacked as
Pagoda stacks them (3 × 16 rank columns), for a decode batch of 64 tokens
spread over 0-4 adapters, and a 512-token prefill on one adapter. Prints the
base matmul's time next to the LoRA delta's, and the error vs the reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagoda.kernels.lora import add_lora, add_lora_reference, lora_groups


def timed(fn: Callable[[], object], n: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1000


def main() -> None:
    torch.manual_seed(0)
    d_in, d_out, width, max_loras = 576, 960, 48, 4
    weight = torch.randn(d_out, d_in) * 0.05
    a = torch.randn(max_loras + 1, width, d_in) * 0.05
    b = torch.randn(max_loras + 1, d_out, width) * 0.05
    a[0], b[0] = 0, 0
    for num_tokens, num_adapters in ((64, 0), (64, 1), (64, 4), (512, 1)):
        x = torch.randn(num_tokens, d_in)
        if num_adapters == 0:
            slots = torch.zeros(num_tokens, dtype=torch.long)
        else:
            slots = torch.arange(num_tokens) % (num_adapters + 1)  # a base token every few
            if num_tokens == 512:
                slots[:] = 1
        groups = lora_groups(slots.tolist(), x.device)
        base = F.linear(x, weight)
        got = add_lora(base.clone(), x, a, b, groups)
        ref = add_lora_reference(base.clone(), x, a, b, slots)
        err = (got - ref).abs().max().item()
        t_base = timed(lambda: F.linear(x, weight))  # noqa: B023
        t_lora = timed(lambda: add_lora(base.clone(), x, a, b, groups))  # noqa: B023
        t_ref = timed(lambda: add_lora_reference(base.clone(), x, a, b, slots), n=5)  # noqa: B023
        print(
            f"tokens {num_tokens:4d} adapters {num_adapters}: base {t_base:.3f} ms, "
            f"grouped LoRA {t_lora:.3f} ms, reference {t_ref:.3f} ms, max err {err:.1e}"
        )


if __name__ == "__main__":
    main()
