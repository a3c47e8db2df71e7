"""Plain-torch references for the Triton ops: the slowest, clearest versions.

Each computes in float32 and casts once at the end, except where the model's
own torch path rounds in between (the residual sum of add + RMSNorm is
stored in the model dtype, as transformers does), which the kernels follow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; negative = skip (padding)
) -> None:
    """Store each token's key/value at its slot (block * block_size + offset)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, kv_heads, head_dim)[slots] = key[keep]
    v_cache.view(-1, kv_heads, head_dim)[slots] = value[keep]


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> torch.Tensor:  # [length, kv_heads, head_dim]
    """The first `length` tokens of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def causal_attention_ref(
    query: torch.Tensor,  # [q_len, heads, head_dim]: the last q_len positions
    key: torch.Tensor,  # [ctx_len, kv_heads, head_dim]
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the last q_len positions of a ctx_len sequence, in float32."""
    q_len, heads, _ = query.shape
    ctx_len, kv_heads, _ = key.shape
    k = key.float().repeat_interleave(heads // kv_heads, dim=1)
    v = value.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    offset = ctx_len - q_len
    rows = torch.arange(q_len, device=query.device)[:, None] + offset
    masked = torch.arange(ctx_len, device=query.device)[None, :] > rows
    scores.masked_fill_(masked[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).to(query.dtype)


def paged_decode_attention_ref(
    query: torch.Tensor,  # [batch, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks]
    seq_lens: torch.Tensor,  # [batch]
    scale: float,
) -> torch.Tensor:
    """One query per sequence, attending to all of its seq_len cached tokens."""
    out = torch.empty_like(query)
    for i, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n)
        v = gather_kv(v_cache, block_tables[i], n)
        out[i] = causal_attention_ref(query[i : i + 1], k, v, scale)[0]
    return out


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, heads, head_dim], sequences back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] query start offsets
    seq_lens: torch.Tensor,  # [num_seqs] context length after this step
    scale: float,
) -> torch.Tensor:
    """Each sequence's queries are its last q_len positions; keys come from the cache."""
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]]
        k = gather_kv(k_cache, block_tables[i], n)
        v = gather_kv(v_cache, block_tables[i], n)
        out[starts[i] : starts[i + 1]] = causal_attention_ref(q, k, v, scale)
    return out


def rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual), rounding as transformers does."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        residual = x
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype), residual


def rope_cos_sin(
    inv_freq: torch.Tensor, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:  # each [max_positions, rot_dim / 2] float32
    """The cos/sin cache; llama3 (or any) scaling lives in inv_freq."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    return freqs.cos(), freqs.sin()


def rotary_ref(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    positions: torch.Tensor,  # [num_tokens]
    cos: torch.Tensor,  # [max_positions, head_dim / 2]
    sin: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    """Rotary embedding: neox rotates the two halves, GPT-J the even/odd pairs."""
    c = cos[positions.long()].float()[:, None, :]
    s = sin[positions.long()].float()[:, None, :]
    xf = x.float()
    if is_neox:
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] → silu(gate) * up, computed in float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)
