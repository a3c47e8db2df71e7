"""The CUDA backend: the Triton kernels (kernels/triton_ops).

TritonBackend describes one step with TritonAttentionMetadata: decode rows
(one query token each) first, then the prompt chunks back to back, as the
CPU path orders them. New keys and values are written into the cache by slot,
then decode rows run the paged decode kernel (split-K for wide block
tables) and prompt chunks the prefill kernel, which reads everything,
including the chunk's own keys, from the cache.

Only imported on the CUDA path (or by tests that run it in Triton's
interpreter): importing it imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.engine_core.attention.backend import AttentionBackend, StepBatch
from pagoda.kernels.triton_ops.activation import silu_and_mul
from pagoda.kernels.triton_ops.cache import reshape_and_cache
from pagoda.kernels.triton_ops.decode_attention import paged_decode_attention
from pagoda.kernels.triton_ops.norm import fused_add_rms_norm, rms_norm
from pagoda.kernels.triton_ops.prefill_attention import paged_prefill_attention
from pagoda.kernels.triton_ops.rotary import rotary_embedding


@dataclass
class TritonAttentionMetadata:
    """Where this step's tokens go in the cache and what each attends to, on device."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 for padding tokens
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decode] int32
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens: torch.Tensor  # [num_prefills + 1] int32, from the first prefill token
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, context after this step
    max_prefill_query_len: int


def _table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    table = torch.zeros((len(rows), max(width, 1)), dtype=torch.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table.to(device, non_blocking=True)


def build_metadata(
    slots: list[int],
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefills: list[tuple[int, int, list[int]]],  # (query_len, context_len, block ids)
    device: torch.device,
) -> TritonAttentionMetadata:
    """Device tensors for one step, from the runner's host-side lists."""
    cu = [0]
    for query_len, _, _ in prefills:
        cu.append(cu[-1] + query_len)
    return TritonAttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
        num_decode_tokens=len(decode_tables),
        decode_block_tables=_table(decode_tables, device),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32).to(device),
        num_prefill_tokens=cu[-1],
        prefill_block_tables=_table([blocks for _, _, blocks in prefills], device),
        prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(device),
        prefill_seq_lens=torch.tensor([c for _, c, _ in prefills], dtype=torch.int32).to(device),
        max_prefill_query_len=max((q for q, _, _ in prefills), default=0),
    )


def triton_paged_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim], may be a strided view
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of this step's queries over the paged cache → [num_tokens, heads, head_dim]."""
    reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    nd = meta.num_decode_tokens
    if nd:
        paged_decode_attention(
            query[:nd],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            out=out[:nd],
        )
    if meta.num_prefill_tokens:
        end = nd + meta.num_prefill_tokens
        paged_prefill_attention(
            query[nd:end],
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_cu_seqlens,
            meta.prefill_seq_lens,
            meta.max_prefill_query_len,
            scale,
            out=out[nd:end],
        )
    return out


class TritonBackend(AttentionBackend):
    """Paged attention, RMSNorm, rotary and SiLU-and-mul as Triton kernels."""

    name = "triton"
    supports_last_rows = False
    cuda_graphs = True

    def build_metadata(self, batch: StepBatch) -> TritonAttentionMetadata:
        prefills = [(p.query_len, p.context_len, p.block_ids) for p in batch.prefills]
        return build_metadata(
            batch.slots, batch.decode_tables, batch.decode_lens, prefills, self.device
        )

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return triton_paged_attention(query, key, value, k_cache, v_cache, meta, scale)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused_add_rms_norm(x, residual, weight, eps)  # in place
        return x, residual

    def rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In place on the (strided) views of qkv; the kernels take the strides.
        rotary_embedding(positions, q, k, cos, sin, is_neox=True)
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
