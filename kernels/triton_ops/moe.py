"""The mixture-of-experts MLP in Triton: grouped expert matmuls over sorted pairs.

The same op as engine_core/models/moe.py's `grouped_experts` (each
(token, expert) pair's `down(silu(gate(x)) * up(x))`, weighted and added to
its token), as two launches of one grouped-GEMM kernel:

- The pairs are sorted by expert once per call (`moe_index`); each expert's
  run is padded to a multiple of BLOCK_M, so a program's BLOCK_M rows all
  belong to one expert, whose weight tile it reads once for the whole tile
  (tl.dot). Padding rows carry the row index -1: never read, never written.
- gemm 1: h[pair] = x[token(pair)] @ w13[expert]^T; silu(gate) * up in torch;
  gemm 2: y[pair] = act[pair] @ w2[expert]^T; the weighted rows are added
  to their tokens with index_add_ (deterministic).

Run on CUDA; the tests run it in Triton's interpreter on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagoda.kernels.triton_ops._common import (
    check_device,
    check_float,
    dot_precision,
    interpreting,
)
from pagoda.kernels.triton_ops._tl import mma

BLOCK_M = 16


@dataclass(frozen=True)
class MoEIndex:
    """The pairs sorted by expert, each expert's run padded to BLOCK_M."""

    rows: torch.Tensor  # [padded]: the token of each sorted pair, -1 for padding
    slots: torch.Tensor  # [padded]: its position in the unsorted pairs, -1 for padding
    experts: torch.Tensor  # [padded // BLOCK_M]: the expert of each BLOCK_M tile


def moe_index(pair_expert: torch.Tensor, pair_token: torch.Tensor, num_experts: int) -> MoEIndex:
    """Sort the pairs by expert and pad each expert's run (one host sync for the counts)."""
    order = torch.argsort(pair_expert, stable=True)
    counts = torch.bincount(pair_expert, minlength=num_experts).tolist()
    padded = [-(-n // BLOCK_M) * BLOCK_M for n in counts]
    total = sum(padded)
    device = pair_expert.device
    rows = torch.full((total,), -1, dtype=torch.int64, device=device)
    slots = torch.full((total,), -1, dtype=torch.int64, device=device)
    experts = []
    start, begin = 0, 0
    for expert, (n, size) in enumerate(zip(counts, padded, strict=True)):
        if n:
            chosen = order[begin : begin + n]
            rows[start : start + n] = pair_token.index_select(0, chosen)
            slots[start : start + n] = chosen
            experts += [expert] * (size // BLOCK_M)
        start += size
        begin += n
    return MoEIndex(rows, slots, torch.tensor(experts, dtype=torch.int64, device=device))


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    rows_ptr,
    experts_ptr,
    out_ptr,
    stride_a,
    stride_we,
    stride_wn,
    stride_o,
    n_features,
    k_features,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    n_tile = tl.program_id(1)
    expert = tl.load(experts_ptr + tile).to(tl.int64)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + m)
    m_ok = row >= 0
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_features
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_features
        a = tl.load(
            a_ptr + row[:, None] * stride_a + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_t = tl.load(  # w[expert]^T tile: [BLOCK_K, BLOCK_N]
            w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None],
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        acc += mma(a, w_t, DOT_PREC, UPCAST)
    out = out_ptr + m[:, None] * stride_o + n[None, :]
    result = acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out, result, mask=m_ok[:, None] & n_ok[None, :])


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """out[i] = a[rows[i]] @ w[expert of i's tile]^T for the rows that are not -1."""
    n_features, k_features = w.shape[1], w.shape[2]
    # Triton's interpreter truncates float32 to bfloat16 where a GPU rounds to
    # nearest: there the kernel writes float32 and torch rounds.
    stored = torch.float32 if interpreting() else a.dtype
    out = torch.empty((rows.shape[0], n_features), dtype=stored, device=a.device)
    if experts.numel() == 0:
        return out.to(a.dtype)
    block_n = min(64, triton.next_power_of_2(n_features))
    block_k = min(64, triton.next_power_of_2(k_features))
    grid = (experts.shape[0], triton.cdiv(n_features, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        rows,
        experts,
        out,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        n_features,
        k_features,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PREC=dot_precision(a.dtype),
        UPCAST=interpreting(),
    )
    return out.to(a.dtype)


def grouped_experts(
    x: torch.Tensor,  # [tokens, hidden]
    w13: torch.Tensor,  # [experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [experts, hidden, inter]
    pair_token: torch.Tensor,  # [pairs]
    pair_expert: torch.Tensor,  # [pairs]
    pair_weight: torch.Tensor,  # [pairs] float32
) -> torch.Tensor:
    """The expert MLP of every (token, expert) pair, weighted and added per token."""
    check_device("grouped_experts", x, w13, w2, pair_token, pair_expert)
    check_float("grouped_experts", x, w13, w2)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    inter = w2.shape[-1]
    index = moe_index(pair_expert, pair_token, w13.shape[0])
    h = _grouped_gemm(x, w13, index.rows, index.experts)  # [padded, 2 * inter]
    act = (F.silu(h[:, :inter]) * h[:, inter:]).contiguous()
    sorted_rows = torch.where(
        index.rows >= 0, torch.arange(index.rows.shape[0], device=x.device), index.rows
    )
    y = _grouped_gemm(act, w2, sorted_rows, index.experts)  # [padded, hidden]
    live = index.slots >= 0
    slots = index.slots[live]
    scale = pair_weight.index_select(0, slots).to(x.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, index.rows[live], y[live] * scale[:, None])
    return out
