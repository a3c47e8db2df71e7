"""Prefill / chunked-prefill attention over the paged cache.

Queries of several sequences lie back to back in one flat batch, delimited
by cu_seqlens_q (query start offsets). Each sequence's queries are the last
q_len positions of its seq_len tokens, so a chunk or a prefix-cache hit
starts mid-sequence and attends to everything cached before it; its own new
keys must already be in the cache (reshape_and_cache first). Causal.

A program covers one (sequence, query tile, KV head). The query tile's rows
are (token, head-in-group) pairs, BLOCK_M of them, so every K/V tile is read
once for the whole GQA group; BLOCK_M // group tokens per query tile. Keys
are walked in tiles of TILE tokens, each token's block looked up in the
block table, so a tile may span blocks and any block size works.
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


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_ot,
    stride_oh,
    scale_log2,
    group,
    head_dim,
    tokens_per_tile,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first = q_tile * tokens_per_tile
    if first < q_len:
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, TILE)
        q_idx = first + m // group
        row_ok = (m < tokens_per_tile * group) & (q_idx < q_len)
        d_ok = d < head_dim
        heads = kvh * group + m % group
        q_pos = seq_len - q_len + q_idx  # absolute position of each row's query
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(
            q_ptr
            + (q_start + q_idx)[:, None] * stride_qt
            + heads[:, None] * stride_qh
            + d[None, :],
            mask=q_mask,
            other=0.0,
        )
        # Keys up to the tile's last query position.
        last_pos = seq_len - q_len + tl.minimum(first + tokens_per_tile, q_len) - 1
        num_tiles = tl.cdiv(last_pos + 1, TILE)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for kv_tile in range(0, num_tiles):
            # Each key's block looked up in the table: a tile may span blocks.
            k_pos = kv_tile * TILE + t
            k_ok = k_pos <= last_pos
            block = tl.load(
                block_tables_ptr + seq * stride_btb + k_pos // BLOCK_SIZE, mask=k_ok, other=0
            ).to(tl.int64)
            kv_off = (
                block[:, None] * stride_cb
                + (k_pos % BLOCK_SIZE)[:, None] * stride_cs
                + kvh * stride_ch
                + d[None, :]
            )
            kv_mask = k_ok[:, None] & d_ok[None, :]
            # Slots past the sequence may hold anything (even NaN): load zeros.
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            qk = mma(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST)
            m_i = m_new

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_off = (q_start + q_idx)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32/int64, cu[0] == 0
    seq_lens: torch.Tensor,  # [num_seqs] context length after this step (>= q_len)
    max_query_len: int,
    scale: float,
    *,
    block_m: int | None = None,
    tile_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher → [num_tokens, heads, head_dim] (rows outside every sequence are untouched).

    block_m: query rows ((token, head) pairs) per program, 64 on CUDA, 16 in the
    interpreter; tile_size: keys per inner step (power of two >= 16, any block
    size), 64 on CUDA, 32 in the interpreter.
    """
    name = "paged_prefill_attention"
    block_size, kv_heads, dtype = check_paged_attention(name, query, k_cache, v_cache, "num_tokens")
    _, heads, head_dim = query.shape
    check_index(name, "block_tables", block_tables, 2)
    check_index(name, "cu_seqlens_q", cu_seqlens_q, 1)
    check_index(name, "seq_lens", seq_lens, 1)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"{name}: cu_seqlens_q / block_tables do not match {num_seqs} sequences")
    if block_tables.stride(1) != 1 or not (
        cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous()
    ):
        raise ValueError(f"{name}: block_tables rows, cu_seqlens_q and seq_lens must be contiguous")
    check_device(name, query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    tile = key_tile(name, tile_size, query.device)
    out = attention_out(name, query, out, dtype)
    if num_seqs == 0 or max_query_len <= 0:
        return out

    group = heads // kv_heads
    if block_m is None:
        block_m = 64 if query.device.type == "cuda" else 16
    block_m = max(block_m, next_pow2(group), 16)
    tokens_per_tile = block_m // group
    grid = (num_seqs, -(-max_query_len // tokens_per_tile), kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        float(scale) * LOG2E, group, head_dim, tokens_per_tile,
        BLOCK_SIZE=block_size,
        TILE=tile,
        BLOCK_M=block_m,
        BLOCK_D=max(16, next_pow2(head_dim)),
        DOT_PREC=dot_precision(dtype),
        UPCAST=interpreting(),
    )  # fmt: skip
    return out
