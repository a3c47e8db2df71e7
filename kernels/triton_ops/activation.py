"""SiLU-and-mul: [num_tokens, 2 * inter] → silu(gate) * up, computed in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_ops._common import check_device, check_float, next_pow2

MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < inter
    gate = tl.load(x_ptr + t * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + inter + i, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_o + i, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: gate_up [num_tokens, 2 * inter] → [num_tokens, inter]."""
    name = "silu_and_mul"
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"{name}: expected gate_up [num_tokens, 2 * inter]")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = gate_up.new_empty(tokens, inter)
    elif out.shape != (tokens, inter):
        raise ValueError(f"{name}: out must be [{tokens}, {inter}]")
    check_float(name, gate_up, out)
    check_device(name, gate_up, out)
    if gate_up.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"{name}: gate_up and out need a unit stride in their last dim")
    if tokens:
        block = min(MAX_BLOCK, next_pow2(inter))
        _silu_and_mul_kernel[(tokens, -(-inter // block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block
        )
    return out
