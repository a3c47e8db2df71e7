"""Triton batched LoRA (kernels/triton_ops/lora.py) against the torch op in kernels/lora.py.

Fresh random inputs per case; the stacks are laid out as LoRAStacks lays
them (k sub-projections side by side along the rank, B block-diagonal, so
q|k|v is one call). Base tokens are poisoned: their x rows and slot 0 of
the stacks hold NaN, so a kernel that reads or writes them shows.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagoda.kernels.lora import add_lora as torch_add_lora  # noqa: E402
from pagoda.kernels.lora import lora_groups  # noqa: E402
from pagoda.kernels.triton_ops.lora import add_lora, lora_index  # noqa: E402
from tests.kernels.triton.helpers import DEVICE, FULL, check_close, grid, randn  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _stacks(
    num_slots: int, rank: int, d_in: int, outs: list[int], dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [slots, k*rank, in], block-diagonal B [slots, sum(outs), k*rank]; slot 0 NaN."""
    width = len(outs) * rank
    a = randn(num_slots, width, d_in, dtype=dtype, gen=gen) / d_in**0.5
    b = torch.zeros(num_slots, sum(outs), width, dtype=dtype, device=DEVICE)
    row = 0
    for j, n in enumerate(outs):
        b[:, row : row + n, j * rank : (j + 1) * rank] = randn(
            num_slots, n, rank, dtype=dtype, gen=gen
        )
        row += n
    a[0] = float("nan")
    b[0] = float("nan")
    return a, b


def _torch_reference(
    base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """The torch op in float32 (slot 0 of the stacks is never read by it either)."""
    x32 = torch.where(torch.isnan(x), 0.0, x.float())  # base rows: no delta, NaN irrelevant
    out = base.float().clone()
    return torch_add_lora(out, x32, a.float(), b.float(), lora_groups(slots, x.device))


SMALL = [
    (1, 8, [24], [1]),
    (1, 16, [16, 8, 8], [0]),
    (7, 8, [16, 8, 8], [0, 2, 1, 2, 0, 3, 2]),
    (13, 16, [40], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]),
    (21, 16, [20, 20], [i % 4 for i in range(21)]),
]
CASES = grid(
    SMALL,
    [1, 7, 40],
    [8, 16],
    [[24], [16, 8, 8]],
    [[1], [0], "mixed"],
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "rank", "outs", "slots"), CASES)
def test_lora_matches_torch_op(
    num_tokens: int, rank: int, outs: list[int], slots: list[int] | str, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 31 + rank + sum(outs))
    num_slots, d_in = 4, 48 if not FULL else 4096
    if slots == "mixed":
        slots = torch.randint(0, num_slots, (num_tokens,), generator=gen).tolist()
    elif len(slots) != num_tokens:
        slots = (slots * num_tokens)[:num_tokens]
    assert isinstance(slots, list)
    a, b = _stacks(num_slots, rank, d_in, outs, dtype, gen)
    x = randn(num_tokens, d_in, dtype=dtype, gen=gen)
    base = randn(num_tokens, sum(outs), dtype=dtype, gen=gen)
    is_base = torch.tensor(slots, device=DEVICE) == 0
    x[is_base] = float("nan")  # never read for a base token
    expected = _torch_reference(base, x, a, b, slots)

    out = base.clone()
    got = add_lora(out, x, a, b, lora_index(slots, DEVICE))
    assert got is out, "the op adds into out in place"
    torch.testing.assert_close(out[is_base], base[is_base], rtol=0, atol=0, equal_nan=False)
    if is_base.all():
        return
    delta, ref_delta = (out.float() - base.float()), (expected - base.float())
    check_close(out[~is_base], expected[~is_base], dtype, f"T={num_tokens} r={rank} {outs}")
    check_close(delta[~is_base], ref_delta[~is_base], dtype, "the LoRA delta alone")


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_split_k_and_wide_token_tiles(num_splits: int) -> None:
    """Split-K shrink (partials summed in the expand) and a group spanning several tiles."""
    gen = torch.Generator().manual_seed(num_splits)
    dtype, num_tokens, d_in, outs = torch.float32, 37, 200, [24]
    slots = [1 if i % 5 else 2 for i in range(num_tokens)]
    a, b = _stacks(3, 8, d_in, outs, dtype, gen)
    x = randn(num_tokens, d_in, dtype=dtype, gen=gen)
    base = randn(num_tokens, sum(outs), dtype=dtype, gen=gen)
    expected = _torch_reference(base, x, a, b, slots)
    out = add_lora(base.clone(), x, a, b, lora_index(slots, DEVICE), num_splits=num_splits)
    check_close(out, expected, dtype, f"num_splits={num_splits}")


def test_accepts_the_torch_ops_groups_and_strided_rows() -> None:
    """Same call as the torch op (groups), x a column slice of a wider tensor."""
    gen = torch.Generator().manual_seed(3)
    dtype, slots = torch.float32, [2, 0, 1, 2, 2]
    a, b = _stacks(3, 8, 32, [16], dtype, gen)
    wide = randn(len(slots), 80, dtype=dtype, gen=gen)
    x = wide[:, 16:48]  # row stride 80
    base = randn(len(slots), 16, dtype=dtype, gen=gen)
    expected = _torch_reference(base, x, a, b, slots)
    got = add_lora(base.clone(), x, a, b, lora_groups(slots, x.device))
    check_close(got, expected, dtype, "groups + strided x")


def test_bad_inputs_raise_value_error() -> None:
    gen = torch.Generator().manual_seed(4)
    a, b = _stacks(3, 8, 32, [16], torch.float32, gen)
    x = randn(4, 32, dtype=torch.float32, gen=gen)
    out = randn(4, 16, dtype=torch.float32, gen=gen)
    index = lora_index([1, 0, 2, 1], DEVICE)
    with pytest.raises(ValueError, match="dtypes differ"):
        add_lora(out, x.bfloat16(), a, b, index)
    with pytest.raises(ValueError, match="B stack"):
        add_lora(out, x, a, b[:, :8], index)
    with pytest.raises(ValueError, match="built for 3 tokens"):
        add_lora(out, x, a, b, lora_index([1, 0, 2], DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        add_lora(out, x.t().contiguous().t(), a, b, index)
    with pytest.raises(ValueError, match="negative slot"):
        lora_index([1, -1], DEVICE)
