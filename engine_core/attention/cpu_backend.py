"""Paged attention in plain torch (the CPU path and the reference).

The runner describes one step's batch with AttentionMetadata. New keys and
values are first written into the paged cache by slot, then:
- decode tokens (one query per sequence) attend in one batched pass over
  their block tables, padded to the longest context and masked;
- prompt chunks attend per sequence with a causal mask that starts at the
  chunk's offset, reading earlier tokens (prefix hits, earlier chunks) from
  the cache. In bfloat16 on a CPU with AVX512-BF16 the compiled kernel does
  this too, one query row per prompt token, in the same single pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_ops


@dataclass
class PrefillSeq:
    """One sequence whose query spans more than one token this step."""

    query_start: int  # offset into the flat token batch
    query_len: int
    context_len: int  # tokens in the sequence after this step
    block_ids: torch.Tensor  # [num_blocks] int64
    # Attended by the compiled kernel (its rows are in prefill_lens) rather
    # than by SDPA.
    compiled: bool = False


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Decode part: the first `num_decode_tokens` flat tokens, one per sequence.
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int64
    decode_seq_lens: torch.Tensor  # [num_decode] int64
    decode_max_len: int
    prefills: list[PrefillSeq]
    # Decode attention by the compiled CPU kernel (kernels/cpu_ops.py) instead
    # of the gather-and-matmul torch path.
    compiled_decode: bool = False
    # Prompt chunks by the compiled kernel too (the PrefillSeqs marked
    # `compiled`): one query row per prompt token, pointing at its sequence's
    # row of prefill_tables and attending to the positions up to and
    # including its own (prefill_lens). The rest go through per-sequence
    # SDPA. None: no compiled prompt rows this step.
    prefill_tables: torch.Tensor | None = None  # [num_compiled, max_blocks] int64
    prefill_table_rows: torch.Tensor | None = None  # [num_rows] int64
    prefill_lens: torch.Tensor | None = None  # [num_rows] int64
    # The flat token index of each compiled row; None when they are all the
    # tokens after the decode rows.
    prefill_query_index: torch.Tensor | None = None  # [num_rows] int64

    @property
    def compiled_decode_only(self) -> bool:
        """Every token is a decode row for the compiled kernel (most steps):
        the cache write and attention can go in one compiled call."""
        return (
            self.compiled_decode
            and self.prefill_tables is None
            and self.num_decode_tokens == self.slot_mapping.shape[0]
        )


def write_kv(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """reshape_and_cache: store new keys/values at their slots (either cache
    layout: contiguous, or heads first as the engine allocates it on the CPU)."""
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


def paged_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of this step's queries over the paged cache → [num_tokens, heads, head_dim]."""
    nd = meta.num_decode_tokens
    if meta.compiled_decode_only:
        return cpu_ops.write_kv_decode_attention(
            query,
            key,
            value,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
        )
    if meta.compiled_decode:  # the compiled write reads k and v in place
        cpu_ops.write_kv_slots(key, value, k_cache, v_cache, meta.slot_mapping)
    else:
        write_kv(key, value.contiguous(), k_cache, v_cache, meta.slot_mapping)
    out = query.new_empty(query.shape)  # contiguous, whatever query's row stride
    if nd and meta.compiled_decode:
        cpu_ops.paged_decode_attention(
            query[:nd],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            out=out[:nd],
        )
    elif nd:
        out[:nd] = decode_attention(
            query[:nd],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            meta.decode_max_len,
            scale,
        )
    if meta.prefill_tables is not None and meta.prefill_lens is not None:
        index = meta.prefill_query_index
        rows = cpu_ops.paged_decode_attention(
            query[nd:] if index is None else query.index_select(0, index),
            k_cache,
            v_cache,
            meta.prefill_tables,
            meta.prefill_lens,
            scale,
            table_rows=meta.prefill_table_rows,
            out=out[nd:] if index is None else None,  # the prompt rows in place
        )
        if index is not None:
            out.index_copy_(0, index, rows)
    for seq in meta.prefills:
        if seq.compiled:
            continue
        q = query[seq.query_start : seq.query_start + seq.query_len]
        if seq.context_len == seq.query_len:
            # Nothing before this chunk: use the fresh keys directly.
            k = key[seq.query_start : seq.query_start + seq.query_len]
            v = value[seq.query_start : seq.query_start + seq.query_len]
        else:
            k = k_cache[seq.block_ids].flatten(0, 1)[: seq.context_len]
            v = v_cache[seq.block_ids].flatten(0, 1)[: seq.context_len]
        out[seq.query_start : seq.query_start + seq.query_len] = prefill_attention(q, k, v, scale)
    return out


def decode_attention(
    query: torch.Tensor,  # [batch, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks]
    seq_lens: torch.Tensor,  # [batch]
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """One query per sequence, batched over the block tables → [batch, heads, head_dim]."""
    batch, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    block_size = k_cache.shape[1]
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks]
    k = k_cache[tables].flatten(1, 2)[:, :max_len]  # [batch, len, kv_heads, head_dim]
    v = v_cache[tables].flatten(1, 2)[:, :max_len]
    q = query.view(batch, kv_heads, group, head_dim)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)).float() * scale  # [batch, kv_heads, group, len]
    positions = torch.arange(max_len, device=query.device)
    pad = positions[None, :] >= seq_lens[:, None]  # [batch, len]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    # Padded slots may hold anything (even NaN); 0 * NaN would leak into the sum.
    v = v.masked_fill(pad[:, :, None, None], 0.0)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))  # [batch, kv_heads, group, head_dim]
    return out.reshape(batch, heads, head_dim)


def prefill_attention(
    query: torch.Tensor,  # [q_len, heads, head_dim]
    key: torch.Tensor,  # [ctx_len, kv_heads, head_dim]
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the last q_len positions of a ctx_len sequence."""
    q_len, ctx_len = query.shape[0], key.shape[0]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    if q_len == ctx_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        offset = ctx_len - q_len
        rows = torch.arange(q_len, device=query.device)[:, None] + offset
        cols = torch.arange(ctx_len, device=query.device)[None, :]
        mask = cols <= rows  # [q_len, ctx_len]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def reference_attention(
    query: torch.Tensor,  # [q_len, heads, head_dim]
    key: torch.Tensor,  # [ctx_len, kv_heads, head_dim]
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The plainest causal attention, for tests: repeat kv heads, mask, softmax."""
    q_len, heads, _ = query.shape
    ctx_len, kv_heads, _ = key.shape
    k = key.repeat_interleave(heads // kv_heads, dim=1).float()
    v = value.repeat_interleave(heads // kv_heads, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    offset = ctx_len - q_len
    mask = torch.arange(ctx_len)[None, :] > (torch.arange(q_len)[:, None] + offset)
    scores.masked_fill_(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).to(query.dtype)
