"""Paged attention for decode: one query token per sequence over its block table.

Each program takes one (sequence, KV head) pair and all the query heads that
share that KV head (GQA/MQA), so every K/V page is read once per group. The
group's heads are the rows of the score tile, padded to 16 because tl.dot
needs it, with an online softmax (log2 domain).

The context is walked in tiles of TILE tokens, each token's block looked
up in the block table, so a tile may span several blocks and any block
size works.

Split-K: for long contexts the context is cut into partitions of
`partition_size` tokens, each program (sequence, KV head, partition) writes
its normalized partial output with its running max and sum, and a reduce
kernel combines the partitions. The partition count depends only on the
block table's width, never on the data, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_ops._common import (
    attention_out,
    check_device,
    check_index,
    check_paged_attention,
    dot_precision,
    interpreting,
    key_tile,
    next_pow2,
)
from pagoda.kernels.triton_ops._tl import mma

LOG2E = 1.4426950408889634
DEFAULT_PARTITION_SIZE = 512  # tokens per split-K partition


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,  # [B, H, D] or, split, partials [B, H, P, D]
    m_ptr,  # split only: [B, H, P] running max (log2 domain)
    l_ptr,  # split only: [B, H, P] running sum
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_op,
    stride_mb,
    stride_mh,
    scale_log2,
    group,
    head_dim,
    tiles_per_part,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, TILE)
    row_ok = g < group
    d_ok = d < head_dim
    heads = kvh * group + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    num_tiles = tl.cdiv(seq_len, TILE)
    tile_start = part * tiles_per_part
    tile_end = tl.minimum(tile_start + tiles_per_part, num_tiles)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile in range(tile_start, tile_end):
        # A tile of TILE tokens may span several cache blocks: look each token's up.
        pos = tile * TILE + t
        valid = pos < seq_len
        block = tl.load(
            block_tables_ptr + b * stride_btb + pos // BLOCK_SIZE, mask=valid, other=0
        ).to(tl.int64)
        kv_off = (
            block[:, None] * stride_cb
            + (pos % BLOCK_SIZE)[:, None] * stride_cs
            + kvh * stride_ch
            + d[None, :]
        )
        kv_mask = valid[:, None] & d_ok[None, :]
        # Slots past seq_len may hold anything (even NaN): load them as zeros.
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        qk = mma(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST)
        m_i = m_new

    # An empty partition (past the end of a shorter sequence) has l_i == 0.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_mask = row_ok[:, None] & d_ok[None, :]
    o_off = b * stride_ob + heads[:, None] * stride_oh + part * stride_op + d[None, :]
    if SPLIT:
        tl.store(out_ptr + o_off, out, mask=o_mask)
        ml_off = b * stride_mb + heads * stride_mh + part
        tl.store(m_ptr + ml_off, m_i, mask=row_ok)
        tl.store(l_ptr + ml_off, l_i, mask=row_ok)
    else:
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _reduce_kernel(
    part_ptr,  # [B, H, P, D] float32
    m_ptr,  # [B, H, P]
    l_ptr,
    seq_lens_ptr,
    out_ptr,  # [B, H, D]
    stride_pb,
    stride_ph,
    stride_pp,
    stride_mb,
    stride_mh,
    stride_ob,
    stride_oh,
    num_parts,
    part_tokens,
    head_dim,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    used = tl.minimum(tl.cdiv(seq_len, part_tokens), num_parts)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_ok = p < used
    ml_off = b * stride_mb + h * stride_mh + p
    m = tl.load(m_ptr + ml_off, mask=p_ok, other=float("-inf"))
    l_part = tl.load(l_ptr + ml_off, mask=p_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0)) * l_part
    w = tl.where(p_ok, w, 0.0)
    part = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + p[:, None] * stride_pp + d[None, :],
        mask=p_ok[:, None] & (d < head_dim)[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


def num_partitions(max_blocks: int, block_size: int, partition_size: int) -> int:
    """Split-K partitions for a block table `max_blocks` wide."""
    return -(-(max_blocks * block_size) // partition_size)


def paged_decode_attention(
    query: torch.Tensor,  # [batch, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [batch] int32/int64, each >= 1
    scale: float,
    *,
    split: bool | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    tile_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher → [batch, heads, head_dim]. `split=None` picks split-K for wide tables.

    tile_size: tokens per inner step (a power of two >= 16, any block size);
    64 on CUDA, 32 in the interpreter, so that tiles there span blocks of 16.
    """
    name = "paged_decode_attention"
    block_size, kv_heads, dtype = check_paged_attention(name, query, k_cache, v_cache, "batch")
    batch, heads, head_dim = query.shape
    check_index(name, "block_tables", block_tables, 2)
    check_index(name, "seq_lens", seq_lens, 1)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(f"{name}: block_tables / seq_lens do not match batch {batch}")
    if block_tables.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError(f"{name}: block_tables rows and seq_lens must be contiguous")
    check_device(name, query, k_cache, v_cache, block_tables, seq_lens)
    tile = key_tile(name, tile_size, query.device)
    if partition_size % tile:
        raise ValueError(f"{name}: partition_size must be a multiple of tile_size {tile}")
    out = attention_out(name, query, out, dtype)
    if batch == 0:
        return out

    group = heads // kv_heads
    parts = num_partitions(block_tables.shape[1], block_size, partition_size)
    if split is None:
        split = parts > 1
    parts = max(parts, 1) if split else 1
    max_tokens = block_tables.shape[1] * block_size
    tiles_per_part = partition_size // tile if split else max(-(-max_tokens // tile), 1)
    common = dict(
        BLOCK_SIZE=block_size,
        TILE=tile,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_D=max(16, next_pow2(head_dim)),
        DOT_PREC=dot_precision(dtype),
        UPCAST=interpreting(),
    )
    scale_log2 = float(scale) * LOG2E
    if not split:
        _decode_kernel[(batch, kv_heads, 1)](
            query, k_cache, v_cache, block_tables, seq_lens, out, out, out,
            query.stride(0), query.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1), 0, 0, 0,
            scale_log2, group, head_dim, tiles_per_part,
            SPLIT=False, **common,
        )  # fmt: skip
        return out

    partial = torch.empty(batch, heads, parts, head_dim, dtype=torch.float32, device=query.device)
    m = torch.empty(batch, heads, parts, dtype=torch.float32, device=query.device)
    lsum = torch.empty_like(m)
    _decode_kernel[(batch, kv_heads, parts)](
        query, k_cache, v_cache, block_tables, seq_lens, partial, m, lsum,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), m.stride(0), m.stride(1),
        scale_log2, group, head_dim, tiles_per_part,
        SPLIT=True, **common,
    )  # fmt: skip
    _reduce_kernel[(batch, heads)](
        partial, m, lsum, seq_lens, out,
        partial.stride(0), partial.stride(1), partial.stride(2),
        m.stride(0), m.stride(1),
        out.stride(0), out.stride(1),
        parts, partition_size, head_dim,
        BLOCK_P=next_pow2(parts), BLOCK_D=next_pow2(head_dim),
    )  # fmt: skip
    return out
