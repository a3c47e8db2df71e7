"""Triton grouped expert MLP (kernels/triton_ops/moe.py) against the torch op
of engine_core/models/moe.py: experts with no tokens, with one, and with more
than a tile's worth; float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagoda.engine_core.models.moe import grouped_experts as torch_grouped  # noqa: E402
from pagoda.kernels.triton_ops.moe import BLOCK_M, grouped_experts, moe_index  # noqa: E402
from tests.kernels.triton.helpers import DEVICE, FULL, check_close, randn, rel_err  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_the_torch_op(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k = (300, 1024, 768, 64, 8) if FULL else (37, 48, 40, 6, 2)
    x = randn(tokens, hidden, dtype=dtype, gen=gen)
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype, gen=gen) / hidden**0.5
    w2 = randn(experts, hidden, inter, dtype=dtype, gen=gen) / inter**0.5
    # Each token's experts, the last one never picked; routing itself is the torch op's.
    ids = torch.stack(
        [torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)]
    ).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    pair_token = torch.arange(tokens, device=DEVICE).repeat_interleave(top_k)
    pair_expert, pair_weight = ids.reshape(-1), weights.reshape(-1)
    counts = torch.bincount(pair_expert, minlength=experts)
    assert counts[-1] == 0 and counts.max() > BLOCK_M  # empty experts and multi-tile ones
    got = grouped_experts(x, w13, w2, pair_token, pair_expert, pair_weight)
    # The reference from the same (rounded) inputs in float32: bfloat16 rounds
    # the intermediates at different points in each implementation.
    want = torch_grouped(x.float(), w13.float(), w2.float(), pair_token, pair_expert, pair_weight)
    check_close(got.float(), want, dtype, "grouped experts")
    if dtype == torch.bfloat16:  # no worse than the torch op itself
        torch_op = torch_grouped(x, w13, w2, pair_token, pair_expert, pair_weight).float()
        assert rel_err(got.float(), want) <= 1.5 * rel_err(torch_op, want)


def test_the_index_pads_each_expert_to_whole_tiles() -> None:
    pair_expert = torch.tensor([2, 0, 2, 2, 0], device=DEVICE)
    pair_token = torch.tensor([0, 0, 1, 2, 2], device=DEVICE)
    index = moe_index(pair_expert, pair_token, 3)
    assert index.experts.tolist() == [0, 2]  # expert 1 has no tile
    rows = index.rows.tolist()
    assert rows[:BLOCK_M] == [0, 2] + [-1] * (BLOCK_M - 2)
    assert rows[BLOCK_M:] == [0, 1, 2] + [-1] * (BLOCK_M - 3)
    assert index.slots.tolist()[BLOCK_M : BLOCK_M + 3] == [0, 2, 3]
