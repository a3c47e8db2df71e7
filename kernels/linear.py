"""Linear layers with weights pre-packed for oneDNN on the CPU.

oneDNN's blocked weight layout, prepared once at load, makes bfloat16
matmuls on this class of CPU about 1.1-1.3x faster at decode batch sizes and
2x faster at batch 1 than `F.linear` on the plain layout, with bit-identical
results. float32 weights are packed too: on a 2-core AVX2 CPU oneDNN runs the
default model's projections at 64 rows 1.1-1.5x faster than `F.linear` (MKL)
and the 49152-wide head 1.5x faster, and 1.7x at 1 row; at 4096-row prompt
chunks it is ~8% slower. The sums are ordered differently from MKL's, so
float32 results differ from transformers' in the last bits (relative ~1e-7),
well inside the parity suite's tolerances. CUDA keeps `F.linear`.

bfloat16 on a CPU with AVX512-BF16 but no AMX runs instead on Pagoda's
pairs kernel (kernels/csrc/linear_bf16.h), at every row count, over weights
packed once into tiles of 48 output columns x pairs of inputs. It does
oneDNN's arithmetic (`vdpbf16ps`, float32 sums, one rounding) but streams
the weights better: over the default model's 30 layers of linears on 2 Zen 4
cores, cold caches (`python scripts/bench_cpu_kernels.py --linear --dtype
bfloat16`), oneDNN vs pairs, ms: 1 row 11.7 vs 4.9, 4 rows 9.6 vs 4.9, 8 rows
11.5 vs 5.9, 16 rows 15.5 vs 9.9, 32 rows 23.2 vs 17.6, 64 rows 39.0 vs
32.7; a 4096-row prompt chunk (4 layers) 283 vs 286; the 49152-wide head at
1 row 1.7 vs 1.0. It also beats the GGUF block kernel (below) from 2 rows (1
row: 4.9 vs 4.6, head 1.0 vs 3.0), so such a Linear keeps only this copy.
A gated MLP's gate|up Linear (glu=True) is packed with each tile holding
24 units' gate and up columns, so the kernel can hand back silu(gate) * up
directly (Linear.silu_and_mul), rounded as the separate op rounds it, and
skip that op's pass over the projection's output.

A few rows (decoding one to a handful of sequences) do almost no arithmetic
per weight, so their time is the time to stream the weights from memory.
The compiled few-row kernel (kernels/csrc/linear.h) reads the plain
[out, in] weights once and does that in about 0.7x oneDNN's time on 2 AVX2
cores at 1-8 rows (figures at SMALL_ROWS_MAX). A Linear keeps that plain
copy beside the packed one when the model asks for it: LlamaModel does while
its linear weights are a small share of the machine's memory, at the cost of
a second copy of them (0.4 GB for the default model in float32). On a CPU
without hardware bfloat16 (or float16) arithmetic, linears in that dtype
run on the kernel at every batch size, with the plain weights as their only
copy: oneDNN is 4-5x slower there.

A model loaded from a GGUF file needs no plain copy: its float32 weights
are the file's Q4_0/Q4_1/Q8_0 blocks dequantized, and the block kernels
(BlockWeight) read those blocks, 14-16% (4-bit) or 27% (Q8_0) of the
float32 bytes, and rebuild each weight in registers with the one rounding
the dequantizer used, so they multiply by exactly the model's float32
weights (figures at BLOCKS_MAX_ROWS). In half precision that is the
unrounded weights, closer to float32 than the model's dense bf16 ones.

oneDNN (and ideep above it) build and cache a primitive, JIT code included,
for every distinct row count they see. A server sees thousands of different
step sizes, and those caches grew the engine by hundreds of MiB over a long
mixed load. The packed path therefore runs at a bounded set of row counts:
the rows are padded up to the next bucket (at most 12.5% more rows, none at
batch sizes up to 8 and at round sizes), and the padding is sliced off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_ops
from pagoda.kernels.linear_int8 import Int8Weight

_PACKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(weight[:8].contiguous(), 1)
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(1, weight.shape[1], dtype=weight.dtype), probe, None, "none", [], ""
        )
    except (RuntimeError, AttributeError):
        return False
    return True


# Row counts up to this run on a Linear's 4-bit weights when it has them: at
# small batches a step streams every weight from memory, and 4-bit weights are
# a quarter of the bytes. Measured over the default model's 30 layers of
# linears on 2 cores: 4.1 vs 13.0 ms at 1 row, 6.9 vs 14.9 at 4, 11.9 vs 16.9
# at 6, even at 8.
INT4_MAX_ROWS = 6


@dataclass
class Int4Weight:
    """4-bit weights in groups along the input dimension, in torch's CPU int4
    layout: w = (q - 8) * scale + zero, with q in 0..15. Scales and zeros are
    in the activations' dtype (torch's float32 variant of the kernel is ~25x
    slower), so a GGUF Q4_1 tensor's float16 scales are rounded to bfloat16."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor  # [in / group, out, 2]
    group: int


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def pack_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> Int4Weight:
    """q [out, in] integers in 0..15; scale and zero [out, in / group]."""
    group = q.shape[1] // scale.shape[1]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype)
    return Int4Weight(packed, scales_zeros, group)


def int4_matmul(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [rows, in] @ w^T; x in the dtype of w's scales."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, w.group, w.scales_zeros)


@dataclass
class BlockWeight:
    """Weights in a GGUF file's block layout (pagoda.engine_core.loaders.gguf.
    load_gguf_blocks): per block of 32 inputs, w = q * scale + offset for
    Q4_0 / Q4_1 (codes uint8 [out, in / 2]), w = q * scale for Q8_0 (codes
    int8 [out, in], offset None). The few-row kernels rebuild them in float32
    exactly as the model's dequantized float32 weights are."""

    codes: torch.Tensor
    scale: torch.Tensor  # [out, in / 32] float32
    offset: torch.Tensor | None  # [out, in / 32] float32, or None (Q8_0)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.offset is None:
            return cpu_ops.linear_q8_small_rows(x, self.codes, self.scale, bias)
        return cpu_ops.linear_q4_small_rows(x, self.codes, self.scale, self.offset, bias)


# Row counts up to which a Linear with GGUF blocks runs on them. Over the
# default model's 30 layers of linears (Q4_1) on 2 AVX2 cores (cold caches;
# `python scripts/bench_cpu_kernels.py --linear`), the block kernel vs the
# float32 few-row kernel vs oneDNN packed, ms: 1 row 6.4 / 20.1 / 25.7, 4
# rows 9.0 / 19.3 / 29.6, 8 rows 17.8 / 25.8 / 34.9, 16 rows 37.1 / 45.4 /
# 45.4, 32 rows 86 / 87 / 69. Half precision the CPU multiplies natively
# keeps to 4 rows, where streaming the weights is the whole of the time (as
# SMALL_ROWS_MAX); without hardware for it, 16 as in float32. On 2 cores with
# AVX512-BF16 and AMX, bfloat16, the block kernel's AVX512 form vs oneDNN:
# 6.9 vs 20-22 ms at 1 row, 9.7 vs 21 at 2, 14.5 vs 22 at 4, 28.5 vs 22 at 8
# (oneDNN 13-15 ms at 1-4 rows in a quieter window). On 2 Zen 4 cores
# (AVX512-BF16, no AMX): 5.5 vs 11.6 ms at 1 row, 5.8 vs 13.1 at 2, 10.4 vs
# 9.6 at 4, 18.0 vs 11.9 at 8.
BLOCKS_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 4, torch.float16: 4}


# Row counts up to which the compiled few-row kernel beats oneDNN's packed
# path. Over the default model's 30 layers of linears on 2 AVX2 cores (cold
# caches; `python scripts/bench_cpu_kernels.py --linear`), oneDNN vs the
# kernel in float32: 25.8 vs 17.1 ms at 1 row, 29.2 vs 19.3 at 4, 31.5 vs
# 25.2 at 8, 42.8 vs 43.5 at 16, 67 vs 82 at 32 (on a slower-memory day:
# 60 vs 43, 85 vs 56, 104-123 vs 91-100 at 16). Half precision keeps to 4
# rows where the CPU multiplies it natively: AVX512-BF16 gives oneDNN twice
# the arithmetic the kernel's float32 FMAs have, and the gain there is the
# bandwidth at the smallest batches. Where it does not, see Linear.
SMALL_ROWS_MAX = {torch.float32: 16, torch.bfloat16: 4, torch.float16: 4}


def pairs_available() -> bool:
    """Whether bfloat16 linears run on the pairs kernel (kernels/csrc/
    linear_bf16.h): on AVX512-BF16 without AMX, where oneDNN has the same
    `vdpbf16ps` arithmetic and the kernel reads the weights faster. With AMX,
    oneDNN's tile multiplies have several times its arithmetic at prompt sizes."""
    return cpu_ops.has_bf16_pairs() and not cpu_ops.cpu_has_flag("amx_bf16")


def padded_rows(m: int) -> int:
    """The bucket m rows run at: m itself up to 8, then multiples of 8 up to 64,
    then 8 evenly spaced sizes per power of two."""
    if m <= 8:
        return m
    step = max(8, 1 << (m.bit_length() - 4))
    return -(-m // step) * step


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] in oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)


class Linear:
    """y = x W^T (+ b), with W [out, in] packed when that is faster."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        int4: Int4Weight | None = None,
        small_rows: bool = False,
        blocks: BlockWeight | None = None,
        glu: bool = False,
        int8: Int8Weight | None = None,
    ) -> None:
        """glu: weight is a gated MLP's gate|up projection (gate rows, then up
        rows); on the pairs kernel it is then packed for silu_and_mul().
        int8: the weights quantized (`--quantization int8`, kernels/
        linear_int8.py); the Linear then runs on them alone at every row
        count and keeps no float copy."""
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.int8 = int8
        # The same weights in 4 bits, for small batches (--quantization gguf).
        self.int4 = int4
        # The same weights as the GGUF file's blocks, exactly, for up to
        # BLOCKS_MAX_ROWS rows; they take the place of the plain copy below.
        self.blocks = blocks if blocks is not None and cpu_ops.load_cpu_ops() is not None else None
        self.blocks_max_rows = BLOCKS_MAX_ROWS[torch.float32]
        if self.blocks is not None:
            small_rows = False
            if cpu_ops.cpu_has_native(weight.dtype):
                self.blocks_max_rows = BLOCKS_MAX_ROWS[weight.dtype]
        self.packed = _can_pack(weight)
        # The weights in the pairs kernel's layout (bfloat16 on AVX512-BF16).
        self.pairs: torch.Tensor | None = None
        # Whether pairs holds gate|up packed for the fused silu(gate) * up.
        self.glu = False
        # Plain weights for the few-row kernel (see the module docstring), used
        # up to small_rows_max rows; None: at every row count.
        self.plain: torch.Tensor | None = None
        self.small_rows_max: int | None = 0
        kernel = self.packed and cpu_ops.load_cpu_ops() is not None
        if int8 is not None:
            # The int8 weights alone, at every row count.
            self.packed = False
            self.weight = int8.packed
            self.int4 = self.blocks = None
        elif kernel and not cpu_ops.cpu_has_native(weight.dtype):
            # Half precision without hardware for it: oneDNN converts as it goes
            # and runs 4-5x slower than the kernel at every batch size (bfloat16
            # on 2 AVX2 cores, gate|up: 30.9 vs 8.1 ms at 128 rows, 959 vs 239 at
            # 4096), so the plain weights are the only copy.
            self.packed = False
            self.weight = self.plain = weight.contiguous()
            self.small_rows_max = None
        elif self.packed and weight.dtype == torch.bfloat16 and pairs_available():
            # The pairs kernel at every row count, in place of oneDNN's copy, the
            # plain one and the GGUF blocks: faster than each of them at their row
            # counts, or level (the blocks at 1 row; see the module docstring).
            self.glu = glu and bias is None and self.out_features % 2 == 0
            self.weight = self.pairs = cpu_ops.pack_bf16_pairs(weight, glu=self.glu)
            self.blocks = None
        elif self.packed:
            self.weight = pack_weight(weight)
            if small_rows and int4 is None and kernel:
                self.plain = weight.contiguous()
                self.small_rows_max = SMALL_ROWS_MAX[weight.dtype]
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in] → [num_tokens, out]
        if self.int8 is not None:
            return self.int8.matmul(x, self.bias)
        int4 = self.int4
        if int4 is not None and x.shape[0] <= INT4_MAX_ROWS and x.dtype == int4.scales_zeros.dtype:
            out = int4_matmul(x, int4)
            return out if self.bias is None else out + self.bias
        rows = x.shape[0]
        if self.blocks is not None and rows <= self.blocks_max_rows:
            return self.blocks.matmul(x, self.bias)
        if self.pairs is not None:
            glu = cpu_ops.GLU_CONCAT if self.glu else 0
            return cpu_ops.linear_bf16_pairs(x, self.pairs, self.out_features, self.bias, glu=glu)
        limit = self.small_rows_max
        if self.plain is not None and (limit is None or rows <= limit):
            return cpu_ops.linear_small_rows(x, self.plain, self.bias)
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        bucket = padded_rows(rows)
        if bucket != rows:
            padded = x.new_empty((bucket, x.shape[1]))
            padded[:rows] = x
            padded[rows:] = 0
            x = padded
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out[:rows] if bucket != rows else out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this gate|up projection in the kernel's one pass
        over the weights, rounded as silu_and_mul of its output is, where it is
        packed for that (glu on the pairs kernel, at this row count); else None."""
        if self.pairs is None or not self.glu:
            return None
        if self.int4 is not None and x.shape[0] <= INT4_MAX_ROWS:
            return None
        return cpu_ops.linear_bf16_pairs(x, self.pairs, self.out_features, glu=cpu_ops.GLU_SILU_MUL)

    def float32_sums(self, x: torch.Tensor) -> torch.Tensor | None:
        """x W^T (+ b) as the float32 sums of the exact bfloat16 products,
        unrounded, where this Linear runs on the pairs kernel; else None."""
        if self.pairs is None or self.glu or self.int4 is not None or x.dtype != torch.bfloat16:
            return None
        return cpu_ops.linear_bf16_pairs(
            x, self.pairs, self.out_features, self.bias, float_out=True
        )


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The plain-torch reference."""
    return F.linear(x, weight, bias)
