"""The dynamic W8A8 linear (kernels/linear_int8.py) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.linear import Linear
from pagoda.kernels.linear_int8 import (
    int8_available,
    pack_int8,
    quantize_int8_activations,
    quantize_int8_per_channel,
    reference_int8_sums,
    reference_linear_int8,
)

needs_vnni = pytest.mark.skipif(not int8_available(), reason="no AVX512-VNNI kernel here")

# (rows, out, in): the default model's projections at decode and prefill
# sizes, and odd sizes (a partial tile of channels, inputs not a multiple of 4).
SHAPES = [
    (1, 960, 576),
    (1, 576, 1536),
    (3, 50, 37),
    (9, 97, 131),
    (64, 3072, 576),
    (130, 576, 1536),
    (5, 1, 5),
]


def _inputs(rows: int, out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * inp**-0.5
    x = torch.randn(rows, inp, generator=g) * 3
    x[0, 0] = 40.0  # an outlier, as real activations have
    return w, x


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "out", "inp"), SHAPES)
def test_int32_sums_match_exactly(rows: int, out: int, inp: int, dtype: torch.dtype) -> None:
    w, x = _inputs(rows, out, inp, seed=rows * 7 + out)
    q, scale = quantize_int8_per_channel(w)
    packed = pack_int8(q, scale)
    x = x.to(dtype)
    assert torch.equal(packed.int32_sums(x), reference_int8_sums(x, q))


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "out", "inp"), SHAPES)
def test_linear_matches_reference(rows: int, out: int, inp: int, dtype: torch.dtype) -> None:
    w, x = _inputs(rows, out, inp, seed=rows + out)
    bias = torch.randn(out)
    q, scale = quantize_int8_per_channel(w)
    x = x.to(dtype)
    y = Linear(w.to(dtype), bias.to(dtype), int8=pack_int8(q, scale))(x)
    ref = reference_linear_int8(x, q, scale, bias.to(dtype))
    assert y.dtype == dtype and y.shape == (rows, out)
    # The same int32 sums, scaled in another order: float rounding apart (one
    # bfloat16 step where the two round either side of a half-way point).
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)
    # And close to the float linear. Row 0's outlier (40 among values of
    # scale 3) makes its quantization step 40 / 127, ~3% of its typical size.
    exact = x.float() @ w.T + bias
    assert float((y.float() - exact).norm() / exact.norm()) < 0.05


def test_quantization_round_trips() -> None:
    w, x = _inputs(4, 64, 96, seed=1)
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert float(((q.float() * scale[:, None]) - w).abs().max()) <= float(scale.max()) / 2 + 1e-6
    qx, sx = quantize_int8_activations(x, group=32)  # 3 groups of 32 inputs a row
    assert sx.shape == (4, 3)
    restored = qx.float().view(4, 3, 32) * sx[:, :, None]
    assert float((restored.view(4, 96) - x).abs().max()) <= float(sx.max()) / 2 + 1e-6
    zeros, s0 = quantize_int8_activations(torch.zeros(2, 8))
    assert not zeros.any() and not s0.any()


@needs_vnni
def test_zero_rows_and_strided_input() -> None:
    w, x = _inputs(6, 40, 64, seed=2)
    q, scale = quantize_int8_per_channel(w)
    packed = pack_int8(q, scale)
    wide = torch.randn(6, 128)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    assert torch.equal(packed.int32_sums(strided), reference_int8_sums(x, q))
    assert packed.matmul(torch.zeros(6, 64), None).abs().max() == 0
    assert packed.matmul(x[:0], None).shape == (0, 40)
