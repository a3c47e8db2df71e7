"""Batched LoRA for a mixed batch in Triton: each token adds its own adapter's delta.

The same op as kernels/lora.py (stacks A [num_slots, rank, in] and B
[num_slots, out, rank] with the scaling folded into B, slot 0 = no adapter,
`out[t] += B[s_t] (A[s_t] x[t])` in place), as two kernels:

- shrink: partial[split, i, :] = x[tok_i, k-range] A[s]^T over one slice of
  the input features, float32. Split-K gives a decode batch (a few tokens of
  one adapter) enough programs to read A at bandwidth; the expand kernel
  sums the partials, so the result is deterministic (no atomics).
- expand: out[tok_i, n-tile] += (sum of partials, rounded to the dtype as
  the torch op rounds x A^T) B[s, n-tile]^T, added in float32.

Tokens are grouped by slot once per step (`lora_index`, one host-to-device
copy reused by every layer and projection); a program covers BLOCK_M tokens
of one slot, so each adapter's A and B tiles are read once per token tile
and the products are tl.dot. Tokens of slot 0 are in no group: the kernels
never read their x, never read slot 0 of the stacks, never write their row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.kernels.lora import LoRAGroups
from pagoda.kernels.triton_ops._common import (
    check_device,
    check_float,
    check_last_dim_contiguous,
    dot_precision,
    interpreting,
    next_pow2,
)
from pagoda.kernels.triton_ops._tl import mma


@dataclass(frozen=True)
class LoRAIndex:
    """A batch's adapter tokens grouped by slot, built once per step.

    `packed` (int32, on the device) holds three arrays back to back: the
    token positions of every adapter token, grouped by slot ascending
    ([num_lora_tokens]), each group's slot ([num_groups]) and each group's
    start in the first array ([num_groups + 1]).
    """

    packed: torch.Tensor
    num_tokens: int  # the batch size it was built for
    num_lora_tokens: int
    num_groups: int
    max_group: int  # tokens in the largest group

    @property
    def slots_offset(self) -> int:
        return self.num_lora_tokens

    @property
    def starts_offset(self) -> int:
        return self.num_lora_tokens + self.num_groups


def lora_index(token_slots: list[int], device: torch.device) -> LoRAIndex:
    """Group the batch's tokens by adapter slot (slot 0, no adapter, left out)."""
    by_slot: dict[int, list[int]] = {}
    for i, slot in enumerate(token_slots):
        if slot < 0:
            raise ValueError(f"lora_index: token {i} has a negative slot {slot}")
        if slot > 0:
            by_slot.setdefault(slot, []).append(i)
    tokens: list[int] = []
    slots: list[int] = []
    starts: list[int] = [0]
    for slot, rows in sorted(by_slot.items()):
        tokens.extend(rows)
        slots.append(slot)
        starts.append(len(tokens))
    packed = torch.tensor(tokens + slots + starts, dtype=torch.int32).to(device)
    return LoRAIndex(
        packed=packed,
        num_tokens=len(token_slots),
        num_lora_tokens=len(tokens),
        num_groups=len(slots),
        max_group=max((len(r) for r in by_slot.values()), default=0),
    )


def index_from_groups(groups: LoRAGroups, num_tokens: int, device: torch.device) -> LoRAIndex:
    """The same index from the torch op's groups (a host sync: tests and benchmarks only)."""
    token_slots = [0] * num_tokens
    for slot, rows in groups:
        for r in rows.tolist():
            token_slots[r] = slot
    return lora_index(token_slots, device)


@triton.jit
def _group_tile(index_ptr, starts_offset, slots_offset, group, tile, BLOCK_M: tl.constexpr):
    """One BLOCK_M tile of an adapter group: (live, slot, rows, row mask, token ids).

    `live` is False for the tiles past the group's end (the grid is sized for the
    largest group); their loads are all masked off.
    """
    start = tl.load(index_ptr + starts_offset + group)
    end = tl.load(index_ptr + starts_offset + group + 1)
    first = start + tile * BLOCK_M
    slot = tl.load(index_ptr + slots_offset + group).to(tl.int64)
    m = first + tl.arange(0, BLOCK_M)
    m_ok = m < end
    tok = tl.load(index_ptr + m, mask=m_ok, other=0).to(tl.int64)
    return first < end, slot, m, m_ok, tok


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    index_ptr,
    partial_ptr,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ps,
    stride_pt,
    in_features,
    rank,
    k_per_split,
    slots_offset,
    starts_offset,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    group = tl.program_id(1)
    split = tl.program_id(2)
    live, slot, m, m_ok, tok = _group_tile(
        index_ptr, starts_offset, slots_offset, group, tile, BLOCK_M
    )
    if live:
        r = tl.arange(0, BLOCK_R)
        r_ok = r < rank
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, in_features)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            xs = tl.load(
                x_ptr + tok[:, None] * stride_xt + k[None, :],
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            a_t = tl.load(  # A[slot]^T tile: [BLOCK_K, BLOCK_R]
                a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                mask=k_ok[:, None] & r_ok[None, :],
                other=0.0,
            )
            acc += mma(xs, a_t, DOT_PREC, UPCAST)
        p_off = split * stride_ps + m[:, None] * stride_pt + r[None, :]
        tl.store(partial_ptr + p_off, acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    partial_ptr,
    b_ptr,
    index_ptr,
    out_ptr,
    stride_ps,
    stride_pt,
    stride_bs,
    stride_bn,
    stride_ot,
    out_features,
    rank,
    num_splits,
    slots_offset,
    starts_offset,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    n_tile = tl.program_id(1)
    group = tl.program_id(2)
    live, slot, m, m_ok, tok = _group_tile(
        index_ptr, starts_offset, slots_offset, group, tile, BLOCK_M
    )
    if live:
        r = tl.arange(0, BLOCK_R)
        r_ok = r < rank
        mr_ok = m_ok[:, None] & r_ok[None, :]
        shrunk = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for s in range(0, num_splits):
            shrunk += tl.load(
                partial_ptr + s * stride_ps + m[:, None] * stride_pt + r[None, :],
                mask=mr_ok,
                other=0.0,
            )
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < out_features
        b_t = tl.load(  # B[slot]^T tile: [BLOCK_R, BLOCK_N]
            b_ptr + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
            mask=r_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        # x A^T rounded to the dtype, as the torch op's first matmul returns it.
        delta = mma(shrunk.to(b_t.dtype), b_t, DOT_PREC, UPCAST)
        o_off = tok[:, None] * stride_ot + n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]
        y = tl.load(out_ptr + o_off, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + o_off, (y + delta).to(out_ptr.dtype.element_ty), mask=o_mask)


def add_lora(
    out: torch.Tensor,  # [num_tokens, out], updated in place
    x: torch.Tensor,  # [num_tokens, in]
    a_stack: torch.Tensor,  # [num_slots, rank, in]
    b_stack: torch.Tensor,  # [num_slots, out, rank]
    index: LoRAIndex | LoRAGroups,
    *,
    block_m: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Launcher: out[t] += B[s_t] (A[s_t] x[t]) for every token t of a slot s_t > 0 → out.

    `index` is the step's LoRAIndex (or the torch op's groups, converted with
    a host sync). block_m: tokens per program (16 in the interpreter, up to
    64 on CUDA); num_splits: split-K factor of the shrink (default: enough
    programs to fill the GPU for a small batch, 1 in the interpreter).
    """
    name = "lora"
    if x.dim() != 2 or out.dim() != 2 or a_stack.dim() != 3 or b_stack.dim() != 3:
        raise ValueError(
            f"{name}: expected out [T, out], x [T, in], A [slots, rank, in], B [slots, out, rank]"
        )
    num_tokens, in_features = x.shape
    num_slots, rank, a_in = a_stack.shape
    if out.shape[0] != num_tokens:
        raise ValueError(f"{name}: out has {out.shape[0]} rows, x has {num_tokens}")
    if a_in != in_features:
        raise ValueError(f"{name}: A stack takes {a_in} input features, x has {in_features}")
    if tuple(b_stack.shape) != (num_slots, out.shape[1], rank):
        raise ValueError(
            f"{name}: B stack must be {(num_slots, out.shape[1], rank)}, got {tuple(b_stack.shape)}"
        )
    dtype = check_float(name, out, x, a_stack, b_stack)
    if not isinstance(index, LoRAIndex):
        index = index_from_groups(index, num_tokens, x.device)
    check_device(name, out, x, a_stack, b_stack, index.packed)
    for what, t in (("out", out), ("x", x), ("a_stack", a_stack), ("b_stack", b_stack)):
        check_last_dim_contiguous(name, what, t)
    if index.num_tokens != num_tokens:
        raise ValueError(f"{name}: index built for {index.num_tokens} tokens, x has {num_tokens}")
    if index.num_groups == 0:
        return out

    cuda = x.device.type == "cuda"
    if block_m is None:
        block_m = min(64, max(16, next_pow2(index.max_group))) if cuda else 16
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"{name}: block_m must be a power of two >= 16, got {block_m}")
    block_k = 64 if cuda else 32
    block_n = 64 if cuda else 32
    block_r = max(16, next_pow2(rank))
    tiles_m = -(-index.max_group // block_m)
    k_chunks = -(-in_features // block_k)
    if num_splits is None:
        # Aim at ~128 shrink programs on CUDA; each split keeps >= 4 K chunks.
        want = -(-128 // (tiles_m * index.num_groups)) if cuda else 1
        num_splits = max(1, min(want, k_chunks // 4))
    num_splits = max(1, min(num_splits, k_chunks))
    k_per_split = -(-k_chunks // num_splits) * block_k
    num_splits = -(-in_features // k_per_split)
    partial = torch.empty(
        num_splits, index.num_lora_tokens, rank, dtype=torch.float32, device=x.device
    )
    prec, upcast = dot_precision(dtype), interpreting()
    _shrink_kernel[(tiles_m, index.num_groups, num_splits)](
        x, a_stack, index.packed, partial,
        x.stride(0), a_stack.stride(0), a_stack.stride(1), partial.stride(0), partial.stride(1),
        in_features, rank, k_per_split, index.slots_offset, index.starts_offset,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, DOT_PREC=prec, UPCAST=upcast,
    )  # fmt: skip
    tiles_n = -(-out.shape[1] // block_n)
    _expand_kernel[(tiles_m, tiles_n, index.num_groups)](
        partial, b_stack, index.packed, out,
        partial.stride(0), partial.stride(1), b_stack.stride(0), b_stack.stride(1), out.stride(0),
        out.shape[1], rank, num_splits, index.slots_offset, index.starts_offset,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, DOT_PREC=prec, UPCAST=upcast,
    )  # fmt: skip
    return out
