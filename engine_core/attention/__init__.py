"""Attention backends: one is chosen when a worker starts (see backend.py)."""

from __future__ import annotations

import torch

from pagoda.engine_core.attention.backend import AttentionBackend, PrefillChunk, StepBatch

__all__ = ["AttentionBackend", "PrefillChunk", "StepBatch", "select_backend"]


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """Triton kernels on CUDA; on the CPU the compiled kernels, or torch without them."""
    if device.type == "cuda":
        from pagoda.engine_core.attention.triton_backend import TritonBackend

        return TritonBackend(device, dtype)
    from pagoda.engine_core.attention.cpu_backend import CpuBackend

    return CpuBackend(device, dtype, head_dim)
