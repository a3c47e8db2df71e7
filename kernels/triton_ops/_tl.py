"""Device-side helpers shared by the Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with a float32 result.

    UPCAST (set when interpreting) computes the product from float32 copies:
    Triton 3.9's interpreter returns garbage for bfloat16 tl.dot. The inputs
    are already rounded to their dtype, so the numbers match the GPU's.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)
