"""Checks shared by the Triton launchers."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether TRITON_INTERPRET is on now; triton itself reads it when kernels are decorated."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device, which Triton can run on (CUDA, or CPU when interpreting)."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"{name}: tensors on different devices ({t.device} vs {device})")
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise ValueError(
            f"{name}: Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1),"
            f" got {device}"
        )


def check_float(name: str, *tensors: torch.Tensor) -> torch.dtype:
    """One shared floating dtype among `tensors`."""
    dtype = tensors[0].dtype
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    for t in tensors:
        if t.dtype != dtype:
            raise ValueError(f"{name}: dtypes differ ({t.dtype} vs {dtype})")
    return dtype


def check_index(name: str, what: str, t: torch.Tensor, dims: int) -> None:
    """An int32/int64 index tensor of `dims` dimensions."""
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: {what} must be int32 or int64, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: {what} must have {dims} dims, got shape {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, what: str, t: torch.Tensor) -> None:
    """Kernels index the last dim with unit stride; other strides are passed in."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: {what} must have a unit stride in its last dim")


def dot_precision(dtype: torch.dtype) -> str:
    """float32 dots in full precision (tf32 would miss the float32 tolerance)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
