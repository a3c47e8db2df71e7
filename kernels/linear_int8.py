"""Dynamic W8A8 linears (`--quantization int8`): int8 weights, int8 activations.

Weights are quantized once, at load, symmetric per output channel: w ~ q_w *
s_w[c], q_w in -127..127 with s_w = max|w[c, :]| / 127. Each row of the
activations is quantized as it arrives, symmetric per token: x ~ q_x * s_x[m].
The products are summed exactly in int32 and scaled: y = (q_x q_w^T) * s_x[m]
* s_w[c] (+ b), rounded once to the activations' dtype.

The kernel is Pagoda's own (kernels/csrc/linear_int8.h, AVX512-VNNI
`vpdpbusd` over weights packed in tiles of 48 channels x 4 inputs), because
it measured faster than what torch offers for this arithmetic on 2 Zen 4
cores (`python scripts/bench_int8_linear.py`, one layer of the default
model's four linears, weights warm in cache): `torch._int_mm` needs more than
16 rows and is 5x slower than the bfloat16 linear at 1 row, and at 512 rows
it is level with this kernel before the per-token quantization and scaling
that it leaves to separate torch ops (~15% more); fbgemm's
`quantized.linear_dynamic` quantizes activations per tensor, not per token
(worse accuracy), runs on deprecated quantized tensors, and is slower at
every size; oneDNN's `qlinear_pointwise` also takes one activation scale per
call. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels import cpu_ops

# Output channels per tile and inputs per group of the packed layout
# (kI8TileCols and vpdpbusd's 4 bytes in kernels/csrc/linear_int8.h).
INT8_TILE_COLS = 48
INT8_GROUP = 4


def int8_available() -> bool:
    """Whether this CPU and build run the int8 kernel (AVX512-VNNI)."""
    return cpu_ops.has_int8_vnni()


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (q [out, in] int8 in -127..127, scale [out] float32),
    symmetric per output channel: W ~ q * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0  # [out]
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in plain torch: x [rows, in] ->
    (q [rows, in] int8, scale [rows] float32), q = round_half_even(x * (127 /
    amax)), scale = amax / 127."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)  # [rows]
    # A true division, as the kernel's (torch's `127.0 / t` is 127 * (1 / t),
    # which differs in the last bit and so moves near-ties).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).to(torch.int8)
    return q, amax / 127.0


@dataclass
class Int8Weight:
    """Int8 weights in the kernel's layout: packed [tiles, in4 / 4, 48, 4] int8
    (channels padded to whole tiles, inputs to a multiple of 4, with zeros),
    wsum [tiles * 48] int32 (each channel's sum of q, for the kernel's +128
    activation shift), scale [tiles * 48] float32."""

    packed: torch.Tensor
    wsum: torch.Tensor
    scale: torch.Tensor
    out_features: int

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] (bfloat16 or float32) @ W^T (+ b), in x's dtype."""
        return cpu_ops.linear_int8(x, self.packed, self.wsum, self.scale, self.out_features, bias)

    def int32_sums(self, x: torch.Tensor) -> torch.Tensor:
        """The exact int32 sums q_x q_w^T of x's per-token quantization."""
        return cpu_ops.linear_int8(
            x, self.packed, self.wsum, self.scale, self.out_features, None, True
        )


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
    """q [out, in] int8 and scale [out] float32 in the kernel's layout."""
    if q.dim() != 2 or q.dtype != torch.int8 or scale.shape != (q.shape[0],):
        raise ValueError("expected q int8 [out, in] and scale [out]")
    outs, ins = q.shape
    tiles = -(-outs // INT8_TILE_COLS)
    groups = -(-ins // INT8_GROUP)
    padded = q.new_zeros(tiles * INT8_TILE_COLS, groups * INT8_GROUP)
    padded[:outs, :ins] = q
    packed = padded.view(tiles, INT8_TILE_COLS, groups, INT8_GROUP).permute(0, 2, 1, 3).contiguous()
    wsum = padded.to(torch.int32).sum(dim=1, dtype=torch.int32)  # [tiles * 48]
    wscale = torch.zeros(tiles * INT8_TILE_COLS, dtype=torch.float32)
    wscale[:outs] = scale.float()
    return Int8Weight(packed, wsum.contiguous(), wscale, outs)


def reference_int8_sums(x: torch.Tensor, q_w: torch.Tensor) -> torch.Tensor:
    """The plain-torch reference of the int32 sums: x quantized per token, times
    q_w^T, summed exactly (float64 holds every such sum exactly)."""
    q_x, _ = quantize_int8_per_token(x)
    return (q_x.double() @ q_w.double().T).to(torch.int32)


def reference_linear_int8(
    x: torch.Tensor, q_w: torch.Tensor, scale_w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The plain-torch reference of the whole linear, in x's dtype."""
    _, scale_x = quantize_int8_per_token(x)
    sums = reference_int8_sums(x, q_w).float()
    y = sums * scale_x[:, None] * scale_w.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
