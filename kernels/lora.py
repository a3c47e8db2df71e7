"""Batched LoRA for a mixed batch: each token adds its own adapter's low-rank delta.

Adapters live in slot-indexed stacks, A [num_slots, rank, in] and
B [num_slots, out, rank] (scaling folded into B); slot 0 is "no adapter"
and holds zeros. The launcher groups the tokens by slot (the groups are
built once per step and reused by every layer) and runs two small matmuls
per adapter present in the batch: shrink (x A^T) then expand (· B^T). Base
rows cost nothing. The reference gathers each token's A and B and runs one
batched matmul per token: simple, and wasteful, which is why it is only the
reference.
"""

from __future__ import annotations

import torch

# (slot, indices of that slot's tokens in the flat batch), slot 0 never listed.
LoRAGroups = list[tuple[int, torch.Tensor]]


def lora_groups(token_slots: list[int], device: torch.device) -> LoRAGroups:
    """Group flat token positions by adapter slot (tokens of slot 0 are left out)."""
    by_slot: dict[int, list[int]] = {}
    for i, slot in enumerate(token_slots):
        if slot > 0:
            by_slot.setdefault(slot, []).append(i)
    return [
        (slot, torch.tensor(rows, dtype=torch.long, device=device))
        for slot, rows in sorted(by_slot.items())
    ]


def add_lora(
    out: torch.Tensor,  # [num_tokens, out], updated in place
    x: torch.Tensor,  # [num_tokens, in]
    a_stack: torch.Tensor,  # [num_slots, rank, in]
    b_stack: torch.Tensor,  # [num_slots, out, rank]
    groups: LoRAGroups,
) -> torch.Tensor:
    """out[t] += B[s_t] (A[s_t] x[t]) for every token t of an adapter slot s_t > 0."""
    for slot, rows in groups:
        if rows.numel() == out.shape[0]:  # the whole batch on one adapter: no gather
            out += (x @ a_stack[slot].T) @ b_stack[slot].T
            continue
        delta = (x.index_select(0, rows) @ a_stack[slot].T) @ b_stack[slot].T  # [n, out]
        out.index_add_(0, rows, delta)
    return out


def add_lora_reference(
    out: torch.Tensor,  # [num_tokens, out]
    x: torch.Tensor,  # [num_tokens, in]
    a_stack: torch.Tensor,  # [num_slots, rank, in]
    b_stack: torch.Tensor,  # [num_slots, out, rank]
    token_slots: torch.Tensor,  # [num_tokens] long, 0 = no adapter
) -> torch.Tensor:
    """Per-token gather + bmm; slot 0 of the stacks must be zeros."""
    a = a_stack[token_slots]  # [num_tokens, rank, in]
    b = b_stack[token_slots]  # [num_tokens, out, rank]
    shrunk = torch.bmm(a, x[:, :, None])  # [num_tokens, rank, 1]
    return out + torch.bmm(b, shrunk)[:, :, 0]
