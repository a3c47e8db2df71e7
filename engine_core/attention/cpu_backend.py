"""The CPU backend: compiled kernels (kernels/cpu_ops.py), plain torch where
they cannot be built.

CpuBackend turns one step's batch into AttentionMetadata. New keys and
values are first written into the paged cache by slot, then:
- decode tokens (one query per sequence) attend in one batched pass over
  their block tables, padded to the longest context and masked;
- prompt chunks attend per sequence with a causal mask that starts at the
  chunk's offset, reading earlier tokens (prefix hits, earlier chunks) from
  the cache. In bfloat16 on a CPU with AVX512-BF16 the compiled kernel does
  this too, one query row per prompt token, in the same single pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.engine_core.attention.backend import AttentionBackend, StepBatch
from pagoda.kernels import cpu_ops

# Prompts of up to this many positions are attended by the compiled kernel
# rather than per-sequence SDPA (where that kernel has no AVX512-BF16 form).
# float32 on 2 AVX2 cores, per layer: 64 prompts of 32 tokens 2.2-3.7 ms vs
# 7.1-7.7 (SDPA); 32 of 128 13-14 vs 17-22; 16 of 256 25-28 vs 27-29; 8 of
# 512 48-64 vs 41-50.
COMPILED_PROMPT_MAX_LEN = 256


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
    # Long prompt chunks in bfloat16: Pagoda's dense kernel (kernels/csrc/
    # dense_attention.h), about 3x torch's SDPA with a causal mask on this CPU.
    dense = (
        bool(meta.prefills)
        and query.dtype == torch.bfloat16
        and query.shape[-1] % 32 == 0
        and query.device.type == "cpu"
        and cpu_ops.has_bf16_dense_attention()
    )
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
        out[seq.query_start : seq.query_start + seq.query_len] = prefill_attention(
            q, k, v, scale, dense
        )
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
    dense: bool = False,
) -> torch.Tensor:
    """Causal attention of the last q_len positions of a ctx_len sequence
    (`dense`: in the compiled bfloat16 kernel, else SDPA)."""
    if dense:
        out = cpu_ops.dense_attention(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), scale, causal=True
        )
        return out.transpose(0, 1)
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


class CpuBackend(AttentionBackend):
    """Compiled paged attention and fused elementwise kernels on the CPU.

    `compiled_ops`: the extension built (else everything is plain torch);
    `compiled_attention`: it also has this head size's attention kernel.
    """

    packs_linears = True

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
        super().__init__(device, dtype)
        self.compiled_ops = cpu_ops.load_cpu_ops() is not None
        self.compiled_attention = self.compiled_ops and head_dim in cpu_ops.SUPPORTED_HEAD_DIMS
        self.name = "cpu-compiled" if self.compiled_ops else "cpu-torch"
        # Prompt tokens through the same kernel, one query row per token, for
        # the sequences it attends faster than per-sequence attention: those
        # of at most COMPILED_PROMPT_MAX_LEN positions (a short prompt's SDPA
        # call is mostly fixed cost; past that, SDPA's blocked matmuls win, and
        # in bfloat16 the dense kernel more so: a 4096-token prompt's prefill
        # 5.8-6.4 s through this kernel, 4.5-4.6 s with the dense one past 256
        # positions, docs/benchmarks.md); all of them in the kernel's
        # AVX512-BF16 form when there is no dense kernel. None: no limit.
        self.compiled_prompt_max_len: int | None = 0
        if self.compiled_attention:
            fast = dtype == torch.bfloat16 and cpu_ops.has_bf16_attention()
            dense = dtype == torch.bfloat16 and cpu_ops.has_bf16_dense_attention()
            self.compiled_prompt_max_len = None if fast and not dense else COMPILED_PROMPT_MAX_LEN

    def kv_cache(
        self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
    ) -> torch.Tensor:
        """Where the compiled kernels read it, the cache is stored heads first (the
        transposed view of [num_blocks, kv_heads, block_size, head_dim]), so that
        a decode work item, one query row and kv head, reads each block's keys
        and values for its head as one run instead of a slice of every
        position's row: a batch-64 decode step's attention takes 7-9% less time
        in bfloat16, and up to 13% less in float32 once blocks are scattered
        (`python scripts/bench_cpu_kernels.py --attention`). The torch path
        keeps the plain layout, which its gathers read without a copy."""
        if not self.compiled_attention:
            return super().kv_cache(num_blocks, block_size, kv_heads, head_dim)
        shape = (num_blocks, kv_heads, block_size, head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device).transpose(1, 2)

    def build_metadata(self, batch: StepBatch) -> AttentionMetadata:
        device = self.device
        max_len = self.compiled_prompt_max_len
        prefills = [
            PrefillSeq(
                p.query_start,
                p.query_len,
                p.context_len,
                torch.tensor(p.block_ids, dtype=torch.long),
                compiled=self.compiled_attention and (max_len is None or p.context_len <= max_len),
            )
            for p in batch.prefills
        ]
        table = _padded_table(batch.decode_tables)
        prefill_tables = prefill_table_rows = prefill_lens = query_index = None
        compiled = [p for p in prefills if p.compiled]
        if compiled:
            assert prefills[0].query_start == len(batch.decode_tables)
            prefill_tables = _padded_table([p.block_ids for p in compiled])
            prefill_table_rows = torch.repeat_interleave(
                torch.arange(len(compiled)), torch.tensor([p.query_len for p in compiled])
            )
            prefill_lens = torch.cat(
                [torch.arange(p.context_len - p.query_len + 1, p.context_len + 1) for p in compiled]
            )
            if len(compiled) < len(prefills):
                query_index = torch.cat(
                    [torch.arange(p.query_start, p.query_start + p.query_len) for p in compiled]
                ).to(device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(batch.slots, dtype=torch.long, device=device),
            num_decode_tokens=len(batch.decode_tables),
            decode_block_tables=table.to(device),
            decode_seq_lens=torch.tensor(batch.decode_lens, dtype=torch.long, device=device),
            decode_max_len=max(batch.decode_lens, default=0),
            prefills=prefills,
            compiled_decode=self.compiled_attention,
            prefill_tables=prefill_tables,
            prefill_table_rows=prefill_table_rows,
            prefill_lens=prefill_lens,
            prefill_query_index=query_index,
        )

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention(query, key, value, k_cache, v_cache, meta, scale)

    def qkv_attention(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor | None:
        """A decode-only step goes from the fused qkv projection to attention in
        one compiled call a layer (rotary, cache write, attention)."""
        if not (self.compiled_ops and meta.compiled_decode_only):
            return None
        return cpu_ops.qkv_decode_attention(
            qkv,
            num_heads,
            positions,
            cos,
            sin,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
        )

    # Fused elementwise kernels. They round where the unfused torch ops
    # (transformers') do; in float32 only a row sum's order differs. 4-8x
    # faster than torch's float32 ops on 2 cores.

    def first_norm(
        self, hidden: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.compiled_ops:
            return super().first_norm(hidden, weight, eps)
        # The fused kernel from a zero residual: residual = hidden, x = its norm.
        residual, x = torch.zeros_like(hidden), hidden
        cpu_ops.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.compiled_ops:
            return super().add_rms_norm(x, residual, weight, eps)
        cpu_ops.fused_add_rms_norm(x, residual, weight, eps)  # in place
        return x, residual

    def rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.compiled_ops:
            return super().rotary(q, k, positions, cos, sin)
        cpu_ops.rotary_embedding(q, k, positions, cos, sin)  # in place on the views of qkv
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.compiled_ops:
            return super().silu_and_mul(gate_up)
        return cpu_ops.silu_and_mul(gate_up)

    def refine_leading_logits(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        mantissa_bits: int,
        max_per_row: int,
    ) -> bool:
        if not self.compiled_ops or hidden.dtype != torch.bfloat16:
            return False
        cpu_ops.refine_leading_logits(
            logits, hidden.contiguous(), weight, bias, mantissa_bits, max_per_row
        )
        return True


def _padded_table(rows: Sequence[list[int] | torch.Tensor]) -> torch.Tensor:
    """Block-id rows of different lengths as one int64 table, zero-padded."""
    width = max((len(r) for r in rows), default=0)
    lists = [r for r in rows if isinstance(r, list)]
    if len(lists) == len(rows):
        # One conversion of the padded lists: a sixth of the time of filling
        # the table row by row (64 rows: ~75 vs ~460 us a step).
        padded = [r + [0] * (width - len(r)) for r in lists]
        return torch.tensor(padded, dtype=torch.long).view(len(rows), width)
    table = torch.zeros((len(rows), width), dtype=torch.long)
    for i, blocks in enumerate(rows):
        table[i, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.long)
    return table
