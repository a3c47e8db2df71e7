"""Sampler: one pass over the batch's logits.

Order: logprobs (the top-N and any requested token ids') are read from the
raw distribution (as vLLM does by default); then logit bias, min_tokens
masking and penalties; then greedy rows take the argmax and the others are
sampled after temperature, top-k, top-p and min-p by the compiled kernel
(kernels/sampling.py), one uniform number a row instead of a noise tensor
the size of the vocabulary. A seeded request draws from Philox keyed by its
seed at the count of tokens it has sampled, so its tokens do not depend on
what else is in the batch, and it continues where it left off after
preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.engine_core.core.plan import GrammarBitmask
from pagoda.engine_core.worker.token_history import TokenHistory
from pagoda.kernels import cpu_ops, sampling
from pagoda.protocol.messages import Logprobs
from pagoda.protocol.sampling_params import SamplingParams

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request of the batch."""

    params: SamplingParams
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    history_slot: int = -1  # its row of the TokenHistory; set for penalized requests


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], history: TokenHistory | None = None
) -> tuple[list[int], list[Logprobs | None]]:
    """logits: float32 [batch, vocab], changed in place → (token id per row, logprobs per row).

    A row with logprob_token_ids but no logprobs gets the chosen token's
    logprob (as logprobs=0 would) besides the requested ones.
    """
    lp_rows = [
        i
        for i, r in enumerate(rows)
        if r.params.logprobs is not None or r.params.logprob_token_ids is not None
    ]
    raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None  # [n, vocab]

    _apply_biases(logits, rows)
    _apply_penalties(logits, rows, history)
    if all(r.params.temperature == 0.0 for r in rows):
        sampled = cpu_ops.argmax_rows(logits).tolist()
    else:
        sampled = _sample_rows(logits, rows).tolist()

    results: list[Logprobs | None] = [None] * len(rows)
    if raw_logprobs is not None:
        chosen = [sampled[i] for i in lp_rows]
        found = _gather_logprobs(
            raw_logprobs, chosen, [rows[i].params.logprobs or 0 for i in lp_rows]
        )
        for j, (i, lp) in enumerate(zip(lp_rows, found, strict=True)):
            requested = rows[i].params.logprob_token_ids
            if lp is not None and requested is not None:
                lp.requested = raw_logprobs[j, requested].tolist()
            results[i] = lp
    return sampled, results


def _apply_biases(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """logit_bias, and min_tokens' ban on stop and EOS tokens, in place."""
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
            logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values())))
        if len(row.output_token_ids) < p.min_tokens:
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(row.eos_token_ids)
            if banned:
                logits[i, list(banned)] = float("-inf")


def _apply_penalties(
    logits: torch.Tensor, rows: list[SamplingRow], history: TokenHistory | None
) -> None:
    """Repetition (prompt + output), frequency and presence (output) penalties, in place."""
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not idx:
        return
    if history is None or any(rows[i].history_slot < 0 for i in idx):
        raise ValueError("penalized rows need their token history")
    slots = [rows[i].history_slot for i in idx]
    params = [rows[i].params for i in idx]
    sampling.apply_penalties(
        logits,
        torch.tensor(idx, dtype=torch.int64),
        history.tensor(),
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor([history.prompt_lens[s] for s in slots], dtype=torch.int64),
        torch.tensor([history.lens[s] for s in slots], dtype=torch.int64),
        torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
        torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
        torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
    )


def _sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Greedy and random rows in one call. Unseeded rows are keyed by a number
    from torch's global generator, seeded rows by their seed."""
    params = [r.params for r in rows]
    keys = torch.randint(_INT64_MIN, _INT64_MAX, (len(rows),), dtype=torch.int64).tolist()
    seeds = [k if p.seed is None else p.seed for k, p in zip(keys, params, strict=True)]
    counters = [0 if r.params.seed is None else len(r.output_token_ids) for r in rows]
    return sampling.sample_rows(
        logits,
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
        torch.tensor([p.min_p for p in params], dtype=torch.float32),
        torch.tensor(seeds, dtype=torch.int64),
        torch.tensor(counters, dtype=torch.int64),
    )


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


def apply_grammar_bitmask(logits: torch.Tensor, row_ids: list[str], mask: GrammarBitmask) -> None:
    """Mask, in place, every token the plan's grammar bitmask forbids.

    logits: float32 [batch, vocab], row i belonging to request row_ids[i];
    every request of the mask samples in this batch.
    """
    import xgrammar as xgr

    where = {request_id: i for i, request_id in enumerate(row_ids)}
    rows = [where[request_id] for request_id in mask.request_ids]
    bits = torch.frombuffer(bytearray(mask.data), dtype=torch.int32).view(len(rows), mask.words)
    full = torch.full((logits.shape[0], mask.words), -1, dtype=torch.int32)  # -1: all allowed
    full[rows] = bits
    xgr.apply_token_bitmask_inplace(logits, full, indices=rows)
