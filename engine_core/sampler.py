"""Sampler: one pass over the batch's logits.

Order: logprobs are read from the raw distribution (as vLLM does by
default); then logit bias, min_tokens masking and penalties; then greedy
rows take the argmax and the others are sampled after temperature, top-k,
top-p and min-p. A seeded request draws its noise from its own generator, so
its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_ops
from protocol.messages import Logprobs
from protocol.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request of the batch."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]


def sample(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int], list[Logprobs | None]]:
    """logits: float32 [batch, vocab] → (token id per row, logprobs per row)."""
    batch, vocab = logits.shape
    want_logprobs = [r.params.logprobs for r in rows]
    raw_logprobs = None
    if any(k is not None for k in want_logprobs):
        raw_logprobs = torch.log_softmax(logits, dim=-1)

    logits = _apply_biases_and_penalties(logits, rows)

    temperatures = [r.params.temperature for r in rows]
    greedy_rows = [i for i, t in enumerate(temperatures) if t == 0.0]
    random_rows = [i for i, t in enumerate(temperatures) if t != 0.0]
    token_ids = torch.empty(batch, dtype=torch.long)
    if len(greedy_rows) == batch:
        token_ids = cpu_ops.argmax_rows(logits)
    elif greedy_rows:
        idx = torch.tensor(greedy_rows)
        token_ids[idx] = cpu_ops.argmax_rows(logits[idx])
    if random_rows:
        idx = torch.tensor(random_rows)
        token_ids[idx] = _sample_random(logits[idx], [rows[i] for i in random_rows])
    sampled = token_ids.tolist()

    results: list[Logprobs | None] = [None] * batch
    if raw_logprobs is not None:
        results = _gather_logprobs(raw_logprobs, sampled, want_logprobs)
    return sampled, results


def _apply_biases_and_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    changed = False
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias or len(row.output_token_ids) < p.min_tokens or p.needs_penalties:
            if not changed:
                logits = logits.clone()
                changed = True
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
            logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values())))
        if len(row.output_token_ids) < p.min_tokens:
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(row.eos_token_ids)
            if banned:
                logits[i, list(banned)] = float("-inf")
    penalty_rows = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if penalty_rows:
        _apply_penalties(logits, [rows[i] for i in penalty_rows], penalty_rows)
    return logits


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], row_idx: list[int]) -> None:
    """Repetition (prompt + output), frequency and presence (output) penalties."""
    vocab = logits.shape[1]
    n = len(rows)
    counts = torch.zeros(n, vocab)
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    for j, row in enumerate(rows):
        if row.output_token_ids:
            out = torch.tensor(row.output_token_ids, dtype=torch.long)
            counts[j].index_add_(0, out, torch.ones(len(out)))
        if row.prompt_token_ids:
            seen[j, torch.tensor(row.prompt_token_ids, dtype=torch.long)] = True
    seen |= counts > 0
    idx = torch.tensor(row_idx)
    sub = logits[idx]
    rep = torch.tensor([r.params.repetition_penalty for r in rows])[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([r.params.frequency_penalty for r in rows])[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows])[:, None]
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[idx] = sub


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then an exponential race per row."""
    temps = torch.tensor([r.params.temperature for r in rows])[:, None]
    logits = logits / temps
    top_ks = [r.params.top_k for r in rows]
    top_ps = [r.params.top_p for r in rows]
    min_ps = [r.params.min_p for r in rows]
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])[:, None]
        ranks = torch.arange(vocab)[None, :]
        drop = ranks >= k
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop |= cum >= torch.tensor(top_ps)[:, None]
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if any(p > 0.0 for p in min_ps):
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps)[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    # Exponential race: argmax(p / q) with q ~ Exp(1) samples from p.
    noise = torch.empty_like(probs)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_()
    for j, row in enumerate(rows):
        if row.generator is not None:
            noise[j] = torch.empty(probs.shape[1]).exponential_(generator=row.generator)
    return cpu_ops.argmax_rows(probs / noise)


def _gather_logprobs(
    raw: torch.Tensor, sampled: list[int], want: list[int | None]
) -> list[Logprobs | None]:
    max_k = max(k for k in want if k is not None)
    top_vals, top_ids = raw.topk(max_k, dim=-1) if max_k > 0 else (None, None)
    chosen = torch.tensor(sampled)
    chosen_lp = raw.gather(1, chosen[:, None])  # [batch, 1]
    ranks = (raw > chosen_lp).sum(dim=-1) + 1
    results: list[Logprobs | None] = []
    for i, k in enumerate(want):
        if k is None:
            results.append(None)
            continue
        ids = [sampled[i]]
        lps = [float(chosen_lp[i, 0])]
        if k > 0 and top_ids is not None and top_vals is not None:
            ids += top_ids[i, :k].tolist()
            lps += top_vals[i, :k].tolist()
        results.append(Logprobs(ids, lps, int(ranks[i])))
    return results


def prompt_logprobs(
    logits: torch.Tensor,  # [n, vocab]: logits at positions p .. p+n-1
    next_token_ids: list[int],  # the prompt tokens at positions p+1 .. p+n
    num_top: int,
) -> list[Logprobs]:
    """Logprobs of prompt tokens given what precedes them."""
    raw = torch.log_softmax(logits, dim=-1)
    return _gather_logprobs(raw, next_token_ids, [num_top] * len(next_token_ids))  # type: ignore[return-value]
