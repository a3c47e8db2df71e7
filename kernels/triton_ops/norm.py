"""RMSNorm, optionally fused with the residual add, one program per token.

Rounding follows transformers: the residual sum is stored in the model
dtype, normalized in float32, cast back, then scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_ops._common import check_device, check_float, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    ok = i < n
    x = tl.load(x_ptr + t * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_r + i, mask=ok, other=0.0).to(tl.float32)
        summed = (x + r).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + t * stride_r + i, summed, mask=ok)
        x = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + i, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"{name}: expected x [num_tokens, hidden] and weight [hidden]")
    for t in others:
        if t.shape != x.shape:
            raise ValueError(f"{name}: shapes differ ({tuple(t.shape)} vs {tuple(x.shape)})")
    check_float(name, x, weight, *others)
    check_device(name, x, weight, *others)
    for t in (x, weight, *others):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: every tensor needs a unit stride in its last dim")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Launcher: rms_norm(x) * weight for x [num_tokens, hidden] → new tensor (or `out`)."""
    if out is None:
        out = torch.empty_like(x)
    _check("rms_norm", x, weight, out)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, x, weight, out, x.stride(0), 0, out.stride(0), x.shape[1], float(eps),
            HAS_RESIDUAL=False, BLOCK_N=next_pow2(x.shape[1]),
        )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """Launcher, in place: residual += x; x = rms_norm(residual) * weight."""
    _check("fused_add_rms_norm", x, weight, residual)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, x, x.stride(0), residual.stride(0), x.stride(0), x.shape[1],
            float(eps), HAS_RESIDUAL=True, BLOCK_N=next_pow2(x.shape[1]),
        )  # fmt: skip
