"""The mixture-of-experts MLP shared by the MoE architectures (Qwen3-MoE, Mixtral).

A router picks each token's top-k experts (softmax over all experts first,
then top-k, renormalised where the architecture says so); each expert is a
SwiGLU MLP. The op groups the (token, expert) pairs by expert and runs one
matmul pair per expert that has tokens, so the work is a loop over experts,
never over tokens; the weighted outputs are added back per token. Under
tensor parallelism every expert is split like a dense MLP (gate|up by
rows, down by columns) and the caller's all-reduce adds the partial sums;
under expert parallelism (--enable-expert-parallel) each rank instead holds
whole experts, a contiguous share of them, computes its experts' part for
every token, and the same all-reduce adds the ranks' parts. Across
data-parallel engines the experts are split over the engines and the tokens
travel (worker/expert_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class MoELayer:
    """One layer's router and its experts' weights, stacked."""

    router: torch.Tensor  # [num_experts, hidden]
    w13: torch.Tensor  # [num_experts, 2 * inter, hidden]: gate rows then up rows
    w2: torch.Tensor  # [num_experts, hidden, inter]
    top_k: int
    renormalize: bool
    # Expert parallelism: this rank holds experts [first_expert, first_expert +
    # len(w13)) whole and adds only their share; the caller's all-reduce sums the ranks'.
    first_expert: int = 0
    # Expert parallelism across data-parallel engines (worker/expert_parallel.py):
    # the exchange that takes this layer's tokens to their experts' engines and back.
    ep: Any = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:
            return self.ep(self, x)
        if self.w13.shape[0] == self.router.shape[0]:
            weights, ids = route(x, self.router, self.top_k, self.renormalize)
            return fused_moe(x, self.w13, self.w2, weights, ids)
        return self.local_share(x)

    def local_share(self, x: torch.Tensor) -> torch.Tensor:
        """The weighted outputs of the experts held here, for every token of x."""
        weights, ids = route(x, self.router, self.top_k, self.renormalize)
        # The pairs whose expert is here, with ids local to this rank.
        local = ids - self.first_expert
        mine = (local >= 0) & (local < self.w13.shape[0])
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        keep = mine.reshape(-1)
        op = grouped_op(x)
        return op(
            x, self.w13, self.w2, tokens[keep], local.reshape(-1)[keep], weights.reshape(-1)[keep]
        )


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k expert ids and their weights ([tokens, k], float32)."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,  # [tokens, hidden]
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,  # [tokens, k] float32
    ids: torch.Tensor,  # [tokens, k]
) -> torch.Tensor:
    """sum over each token's experts of weight * down(silu(gate(x)) * up(x)), in x's dtype."""
    tokens, k = ids.shape
    pair_token = torch.arange(tokens, device=x.device).repeat_interleave(k)
    op = grouped_op(x)
    return op(x, w13, w2, pair_token, ids.reshape(-1), weights.reshape(-1))


def grouped_op(x: torch.Tensor) -> Any:
    """The Triton kernel on CUDA (kernels/triton_ops/moe.py), the torch op elsewhere."""
    if x.is_cuda:
        from pagoda.kernels.triton_ops.moe import grouped_experts as triton_grouped

        return triton_grouped
    return grouped_experts


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    pair_token: torch.Tensor,  # [pairs]: each (token, expert) pair's token
    pair_expert: torch.Tensor,  # [pairs]: its expert (an index into w13 / w2)
    pair_weight: torch.Tensor,  # [pairs] float32
) -> torch.Tensor:
    """The pairs grouped by expert, one matmul pair per expert with pairs, the
    weighted outputs added to their tokens."""
    inter = w2.shape[-1]
    order = torch.argsort(pair_expert, stable=True)
    token_of = pair_token.index_select(0, order)
    counts = torch.bincount(pair_expert, minlength=w13.shape[0]).tolist()
    grouped = x.index_select(0, token_of)
    out_rows = torch.empty_like(grouped)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = grouped[start : start + n]
        h = rows @ w13[expert].t()  # [n, 2 * inter]
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out_rows[start : start + n] = act @ w2[expert].t()
        start += n
    scale = pair_weight.index_select(0, order).to(x.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, out_rows * scale[:, None])
    return out


def moe_reference(
    x: torch.Tensor,
    router: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """The plain per-token definition (tests check fused_moe against it)."""
    weights, ids = route(x, router, top_k, renormalize)
    inter = w2.shape[-1]
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            h = x[t].float() @ w13[e].float().t()
            y = (F.silu(h[:inter]) * h[inter:]) @ w2[e].float().t()
            out[t] += weights[t, j] * y
    return out.to(x.dtype)
