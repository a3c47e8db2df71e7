"""Dynamic W8A8 linears (`--quantization int8`): int8 weights, int8 activations.

Weights are quantized once, at load, symmetric per output channel: w ~ q_w *
s_w[c], q_w in -127..127 with s_w = max|w[c, :]| / 127. Each row of the
activations is quantized as it arrives, symmetric per token and per group of
64 consecutive inputs (INT8_ACT_GROUP): x ~ q_x * s_x[m, g]. The products are
summed exactly in int32 per group, scaled by s_x into float32, summed over
the groups and scaled by s_w (+ b), rounded once to the activations' dtype.

One activation scale per token spends the 8 bits on the few outlier
channels that LLM activations have: on the default model that alone cost
+2.3% perplexity on English text, against +0.2% with groups of 64 (whole
model, weights int8 too: +3.7% vs +1%; docs/benchmarks.md). The group costs
one float multiply-add per 16 `vpdpbusd`.

The kernel is Pagoda's own (kernels/csrc/linear_int8.h, AVX512-VNNI
`vpdpbusd` over weights packed in tiles of 48 channels x 4 inputs), because
it measured faster than what torch offers for this arithmetic on 2 Zen 4
cores (`python scripts/bench_int8_linear.py`, docs/benchmarks.md):
`torch._int_mm` needs more than 16 rows (the decode sizes are not served at
all) and at 32-512 rows it is slower than this kernel before the separate
torch ops that quantize and scale around it; fbgemm's
`quantized.linear_dynamic` quantizes activations per tensor (worse accuracy
still), runs on deprecated quantized tensors and measured slower; oneDNN's
`qlinear_pointwise` also takes one activation scale per call. None of them
has per-group activation scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels import cpu_ops

# Output channels per tile and inputs per group of the packed layout
# (kI8TileCols and vpdpbusd's 4 bytes in kernels/csrc/linear_int8.h), and
# inputs per activation scale (kI8Group).
INT8_TILE_COLS = 48
INT8_GROUP = 4
INT8_ACT_GROUP = 64


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


def quantize_int8_activations(
    x: torch.Tensor, group: int = INT8_ACT_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in plain torch: x [rows, in] ->
    (q [rows, in] int8, scale [rows, ceil(in / group)] float32), per row and
    group of inputs q = round_half_even(x * (127 / amax)), scale = amax / 127."""
    rows, ins = x.shape
    groups = -(-ins // group)
    xf = x.float().new_zeros(rows, groups * group)
    xf[:, :ins] = x.float()
    xg = xf.view(rows, groups, group)
    amax = xg.abs().amax(dim=2)  # [rows, groups]
    # A true division, as the kernel's (torch's `127.0 / t` is 127 * (1 / t),
    # which differs in the last bit and so moves near-ties).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xg * inv[:, :, None]).to(torch.int8).view(rows, -1)[:, :ins]
    return q, amax / 127.0


@dataclass
class Int8Weight:
    """Int8 weights in the kernel's layout: packed [tiles, in4 / 4, 48, 4] uint8
    holding q + 128 (channels padded to whole tiles, inputs to a multiple of 4,
    with q = 0), scale [tiles * 48] float32."""

    packed: torch.Tensor
    scale: torch.Tensor
    out_features: int

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] (bfloat16 or float32) @ W^T (+ b), in x's dtype."""
        return cpu_ops.linear_int8(x, self.packed, self.scale, self.out_features, bias)

    def int32_sums(self, x: torch.Tensor) -> torch.Tensor:
        """The exact int32 sums q_x q_w^T of x's quantization, unscaled."""
        return cpu_ops.linear_int8(x, self.packed, self.scale, self.out_features, None, True)


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
    """q [out, in] int8 and scale [out] float32 in the kernel's layout."""
    if q.dim() != 2 or q.dtype != torch.int8 or scale.shape != (q.shape[0],):
        raise ValueError("expected q int8 [out, in] and scale [out]")
    outs, ins = q.shape
    tiles = -(-outs // INT8_TILE_COLS)
    groups = -(-ins // INT8_GROUP)
    # + 128: vpdpbusd's unsigned operand (the kernel takes 128 * sum q_x off).
    padded = torch.full((tiles * INT8_TILE_COLS, groups * INT8_GROUP), 128, dtype=torch.uint8)
    padded[:outs, :ins] = (q.to(torch.int16) + 128).to(torch.uint8)
    packed = padded.view(tiles, INT8_TILE_COLS, groups, INT8_GROUP).permute(0, 2, 1, 3).contiguous()
    wscale = torch.zeros(tiles * INT8_TILE_COLS, dtype=torch.float32)
    wscale[:outs] = scale.float()
    return Int8Weight(packed, wscale, outs)


def reference_int8_sums(x: torch.Tensor, q_w: torch.Tensor) -> torch.Tensor:
    """The plain-torch reference of the int32 sums: x quantized as the kernel
    does, times q_w^T, summed exactly (float64 holds every such sum exactly)."""
    q_x, _ = quantize_int8_activations(x)
    return (q_x.double() @ q_w.double().T).to(torch.int32)


def reference_linear_int8(
    x: torch.Tensor, q_w: torch.Tensor, scale_w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The plain-torch reference of the whole linear, in x's dtype."""
    q_x, scale_x = quantize_int8_activations(x)
    total = torch.zeros(x.shape[0], q_w.shape[0], dtype=torch.float32)
    for g in range(scale_x.shape[1]):
        cols = slice(g * INT8_ACT_GROUP, (g + 1) * INT8_ACT_GROUP)
        sums = (q_x[:, cols].double() @ q_w[:, cols].double().T).float()  # exact
        total += sums * scale_x[:, g : g + 1]
    y = total * scale_w.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
