"""reshape_and_cache: write this step's keys and values into the paged cache.

Cache layout per layer: [num_blocks, block_size, kv_heads, head_dim]. Token t
goes to slot_mapping[t] = block * block_size + offset; a negative slot marks
a padding token (a CUDA-graph batch padded to its captured size) and is
skipped. key/value may be strided views of the fused qkv projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_ops._common import (
    check_device,
    check_float,
    check_index,
    check_last_dim_contiguous,
    next_pow2,
)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < kv_heads) & (d < head_dim)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64
) -> None:
    """Launcher: checks inputs, then writes key/value at their slots (in place)."""
    name = "reshape_and_cache"
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"{name}: key and value must be [num_tokens, kv_heads, head_dim]")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: caches must be [num_blocks, block_size, kv_heads, head_dim]")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{name}: k_cache and v_cache must share strides")
    num_tokens, kv_heads, head_dim = key.shape
    if tuple(k_cache.shape[2:]) != (kv_heads, head_dim):
        raise ValueError(
            f"{name}: key is {tuple(key.shape)} but the cache holds "
            f"[{k_cache.shape[2]} kv_heads, {k_cache.shape[3]} head_dim]"
        )
    check_index(name, "slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"{name}: slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens}")
    check_float(name, key, value, k_cache, v_cache)
    check_device(name, key, value, k_cache, v_cache, slot_mapping)
    for what, t in (("key", key), ("value", value), ("k_cache", k_cache)):
        check_last_dim_contiguous(name, what, t)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        kv_heads,
        head_dim,
        BLOCK_H=next_pow2(kv_heads),
        BLOCK_D=next_pow2(head_dim),
    )
