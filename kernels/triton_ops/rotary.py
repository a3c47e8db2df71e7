"""Rotary embedding applied in place to query and key, one program per token.

Neox layout rotates the two halves of each head; GPT-J layout rotates the
(even, odd) pairs. The angles come from a cos/sin cache indexed by position,
[max_positions, head_dim / 2], so llama3 (or any) frequency scaling is done
once when the cache is built. Computed in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_ops._common import check_device, check_float, check_index, next_pow2


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, t, heads, half, c, s, IS_NEOX: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (i < half)
    if IS_NEOX:
        i1 = i
        i2 = i + half
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    tl.store(base + i1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + i2, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    q_heads,
    k_heads,
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i < half, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=i < half, other=0.0).to(tl.float32)
    _rotate(q_ptr, stride_qt, stride_qh, t, q_heads, half, c, s, IS_NEOX, BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr, stride_kt, stride_kh, t, k_heads, half, c, s, IS_NEOX, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    query: torch.Tensor,  # [num_tokens, heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [max_positions, head_dim / 2]
    sin: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Launcher: rotates query and key in place (they may be strided views of qkv)."""
    name = "rotary_embedding"
    if query.dim() != 3 or key.dim() != 3 or key.shape[0] != query.shape[0]:
        raise ValueError(f"{name}: query/key must be [num_tokens, heads, head_dim]")
    head_dim = query.shape[2]
    if key.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"{name}: query and key need one even head_dim")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] * 2 != head_dim:
        raise ValueError(f"{name}: cos/sin must be [max_positions, head_dim / 2] (full rotary)")
    check_index(name, "positions", positions, 1)
    if positions.shape[0] != query.shape[0]:
        raise ValueError(f"{name}: {positions.shape[0]} positions for {query.shape[0]} tokens")
    check_float(name, query, key)
    check_float(name, cos, sin)
    check_device(name, positions, query, key, cos, sin)
    for what, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {what} needs a unit stride in its last dim")
    if cos.stride() != sin.stride():
        raise ValueError(f"{name}: cos and sin must share a layout")
    if query.shape[0] == 0:
        return
    _rotary_kernel[(query.shape[0],)](
        query, key, positions, cos, sin,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0),
        query.shape[1], key.shape[1], head_dim // 2,
        IS_NEOX=is_neox,
        BLOCK_HQ=next_pow2(query.shape[1]),
        BLOCK_HK=next_pow2(key.shape[1]),
        BLOCK_HALF=next_pow2(head_dim // 2),
    )  # fmt: skip
