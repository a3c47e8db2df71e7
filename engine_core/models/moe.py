"""The mixture-of-experts MLP shared by the MoE architectures (Qwen3-MoE, Mixtral).

A router picks each token's top-k experts (softmax over all experts first,
then top-k, renormalised where the architecture says so); each expert is a
SwiGLU MLP. The op groups the (token, expert) pairs by expert and runs one
matmul pair per expert that has tokens, so the work is a loop over experts,
never over tokens; the weighted outputs are added back per token. Under
tensor parallelism every expert is split like a dense MLP (gate|up by
rows, down by columns) and the caller's all-reduce adds the partial sums.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.router, self.top_k, self.renormalize)
        return fused_moe(x, self.w13, self.w2, weights, ids)


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
    inter = w2.shape[-1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k  # the token of each (token, expert) pair, grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
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
    scale = weights.reshape(-1).index_select(0, order).to(x.dtype)
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
