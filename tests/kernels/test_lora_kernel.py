"""kernels/lora.py: the grouped batched LoRA against the per-token gather reference."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.lora import add_lora, add_lora_reference, lora_groups


def _case(
    num_tokens: int, num_slots: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rank, d_in, d_out = 8, 48, 80
    x = torch.randn(num_tokens, d_in, generator=g).to(dtype)
    a = torch.randn(num_slots, rank, d_in, generator=g).to(dtype)
    b = torch.randn(num_slots, d_out, rank, generator=g).to(dtype)
    a[0] = 0  # slot 0: no adapter
    b[0] = 0
    base = torch.randn(num_tokens, d_out, generator=g).to(dtype)
    slots = torch.randint(0, num_slots, (num_tokens,), generator=g)
    return x, a, b, base, slots


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("num_slots", [2, 4])
def test_grouped_lora_matches_reference_float32(num_tokens: int, num_slots: int) -> None:
    x, a, b, base, slots = _case(num_tokens, num_slots, torch.float32, num_tokens + num_slots)
    expected = add_lora_reference(base.clone(), x, a, b, slots)
    got = add_lora(base.clone(), x, a, b, lora_groups(slots.tolist(), x.device))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    if (slots > 0).any():
        assert not torch.allclose(got, base), "the adapters changed nothing"


def test_grouped_lora_bfloat16_and_uniform_batches() -> None:
    x, a, b, base, _ = _case(16, 3, torch.bfloat16, 7)
    for slot in (0, 2):  # the whole batch on one slot (the no-gather path), and on none
        slots = torch.full((16,), slot, dtype=torch.long)
        expected = add_lora_reference(base.float(), x.float(), a.float(), b.float(), slots)
        got = add_lora(base.clone(), x, a, b, lora_groups(slots.tolist(), x.device))
        torch.testing.assert_close(got.float(), expected, atol=0.25, rtol=0.02)


def test_groups_leave_out_base_tokens() -> None:
    groups = lora_groups([0, 2, 1, 2, 0], torch.device("cpu"))
    assert [(s, r.tolist()) for s, r in groups] == [(1, [2]), (2, [1, 3])]
