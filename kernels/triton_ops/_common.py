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


def check_paged_attention(
    name: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: str
) -> tuple[int, int, torch.dtype]:
    """query [rows, heads, head_dim] against paged caches [num_blocks, block_size, kv_heads,
    head_dim] of one layout → (block_size, kv_heads, dtype)."""
    if query.dim() != 3:
        raise ValueError(f"{name}: query must be [{rows}, heads, head_dim]")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"{name}: caches must be [num_blocks, block_size, kv_heads, head_dim] with one layout"
        )
    _, heads, head_dim = query.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"{name}: query head_dim {head_dim} != cache head_dim {cache_dim}")
    if heads % kv_heads != 0:
        raise ValueError(f"{name}: {heads} query heads not a multiple of {kv_heads} kv heads")
    dtype = check_float(name, query, k_cache, v_cache)
    check_last_dim_contiguous(name, "query", query)
    check_last_dim_contiguous(name, "k_cache", k_cache)
    return block_size, kv_heads, dtype


def attention_out(
    name: str, query: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The caller's `out` once checked against the query, or a new one like it."""
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must match query's shape and dtype")
    return out


def key_tile(name: str, tile_size: int | None, device: torch.device) -> int:
    """Keys per inner step: 64 on CUDA, 32 in the interpreter (tiles there span blocks of 16)."""
    tile = tile_size or (64 if device.type == "cuda" else 32)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"{name}: tile_size must be a power of two >= 16, got {tile}")
    return tile
