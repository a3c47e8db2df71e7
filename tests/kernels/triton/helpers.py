"""Shared inputs and measures for the Triton kernel tests.

PAGODA_TRITON_FULL=1 (scripts/gpu_check.sh sets it) raises the shapes to
real model sizes and widens the parameter grid; the default keeps them tiny
because the interpreter runs each program in Python.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

FULL = os.environ.get("PAGODA_TRITON_FULL", "0") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm())


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten or masked badly)"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]}"


def poisoned(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write shows."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=DEVICE)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def grid(small: list[tuple[Any, ...]], *axes: list[Any]) -> list[tuple[Any, ...]]:
    """A handful of hand-picked cases, or the full product of the axes under FULL."""
    return list(itertools.product(*axes)) if FULL else small


def make_paged_cache(
    lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches (NaN in the spare blocks) and block tables scattered at random.

    Table entries past a sequence's blocks point at a NaN block, so a kernel
    that reads past seq_len without masking produces NaN.
    """
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = randn(*shape, dtype=dtype, gen=gen)
    v_cache = randn(*shape, dtype=dtype, gen=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spare = order.pop()
    k_cache[spare] = float("nan")
    v_cache[spare] = float("nan")
    width = max(blocks_per_seq) + 1
    tables = torch.full((len(lens), width), spare, dtype=torch.int32)
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
    # NaN also in the unused tail of each sequence's last block.
    for i, n in enumerate(lens):
        if n % block_size:
            last = int(tables[i, blocks_per_seq[i] - 1])
            k_cache[last, n % block_size :] = float("nan")
            v_cache[last, n % block_size :] = float("nan")
    return k_cache, v_cache, tables.to(DEVICE)


def use_triton_backend(runner: Any) -> None:
    """Run a model runner's steps through the Triton backend (in the interpreter
    on a machine without CUDA), keeping the caches it has."""
    from pagoda.engine_core.attention.triton_backend import TritonBackend

    runner.backend = runner.model.backend = TritonBackend(runner.device, runner.dtype)
