"""The attention backend interface, chosen once when a worker starts.

A backend owns what differs between devices in a decoder's forward pass: the
KV cache layout, the per-step attention metadata, paged attention itself,
and the elementwise ops around it (RMSNorm, add + RMSNorm, rotary,
SiLU-and-mul). Models call these and hold no device checks; the runner
builds a `StepBatch` and asks the backend for its metadata.

- cpu_backend.CpuBackend: the compiled CPU kernels (kernels/cpu_ops.py), or
  plain torch where they cannot be built (no compiler, unsupported head size);
- triton_backend.TritonBackend: the Triton kernels on CUDA.

The methods here are the plain-torch versions, rounding where transformers
rounds; backends replace what they do faster.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence whose query spans more than one token this step."""

    query_start: int  # offset into the flat token batch
    query_len: int
    context_len: int  # tokens in the sequence after this step
    block_ids: list[int]  # its blocks covering context_len


@dataclass
class StepBatch:
    """One step's tokens as attention sees them: decode rows first, then prompt chunks."""

    slots: list[int]  # each flat token's cache slot
    decode_tables: list[list[int]]  # per decode row: its block table
    decode_lens: list[int]  # per decode row: its context length
    prefills: list[PrefillChunk]


class AttentionBackend(ABC):
    """Paged attention and the ops around it, for one device and dtype."""

    name = "torch"
    # Linears run on Pagoda's CPU kernels: small-row weight copies, GGUF
    # blocks and 4-bit weights apply (kernels/linear.py).
    packs_linears = False
    # A forward may compute its last layer's MLP on the sampled rows alone.
    supports_last_rows = True
    # Decode-only steps can be captured as CUDA graphs (worker/cuda_graphs.py).
    cuda_graphs = False

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    # ------------------------------------------------------- cache, metadata

    def kv_cache(
        self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
    ) -> torch.Tensor:
        """One layer's key (or value) cache, [num_blocks, block_size, kv_heads, head_dim]."""
        shape = (num_blocks, block_size, kv_heads, head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    @abstractmethod
    def build_metadata(self, batch: StepBatch) -> Any:
        """This step's attention metadata (device tensors) from the runner's lists."""

    @abstractmethod
    def attention(
        self,
        query: torch.Tensor,  # [num_tokens, heads, head_dim]
        key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's keys and values, attend over the paged cache → [T, heads, d]."""

    def qkv_attention(
        self,
        qkv: torch.Tensor,  # [num_tokens, (heads + 2 kv_heads) * head_dim]
        num_heads: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        scale: float,
    ) -> torch.Tensor | None:
        """Rotary, cache write and attention from the fused projection in one call,
        where the backend has such a kernel for this step; else None."""
        return None

    # -------------------------------------------------------- elementwise ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_torch(x, weight, eps)

    def first_norm(
        self, hidden: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(hidden), hidden): the first layer's input and the residual."""
        return self.rms_norm(hidden, weight, eps), hidden

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); backends may reuse x and residual."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rotary(
        self,
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,  # [max_positions, head_dim / 2]
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style rotary embedding of q and k (in place where the backend can)."""
        c = cos[positions][:, None, :]
        s = sin[positions][:, None, :]
        return apply_rope(q, c, s), apply_rope(k, c, s)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 2 * inter] → silu(gate) * up, [num_tokens, inter]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def refine_leading_logits(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        mantissa_bits: int,
        max_per_row: int,
    ) -> bool:
        """Recompute in float32 the logits near each row's maximum, in one compiled
        call; False where the backend has no such kernel (the model does it in torch)."""
        return False

    def __repr__(self) -> str:
        return self.name


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers does: normalize in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding: rotate the two halves of each head."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
