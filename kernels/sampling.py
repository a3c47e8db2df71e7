"""Sampling kernels: a token per row by a race over a few hundred draws,
penalties from token histories, and counter-based uniforms for seeded
requests.

Each launcher runs the compiled CPU op (kernels/csrc/sampling.h) when it is
built and the tensors are float32 on the CPU, and otherwise its plain-torch
reference below, which defines what the op computes:

- `sample_rows`: per row, temperature (0: the argmax), then top-k (ties with
  the k-th value kept), top-p over what top-k kept (a token stays while the
  probability mass before it is below top_p), then min-p (p >= min_p times
  the largest p), in transformers' order; the token wins an exponential race
  (argmax p_i / E_i, E_i ~ Exp(1)) among the kept tokens, run in two levels:
  blocks of 256 tokens by their sums, then the winning block's tokens. Only
  a few hundred E are drawn a row instead of a noise tensor the size of the
  vocabulary, no sort of the whole row is needed, and unlike an inverse CDF
  the winner only changes where two scores nearly tie, so logits that differ
  in their last bits almost never change a seeded request's token.
- `apply_penalties`: repetition penalty on every token of the prompt and
  output, frequency and presence penalties on the output's counts.
- `philox_uniforms`: Philox4x32-10 keyed by a request's seed at the count of
  tokens it has sampled (and a round and an index), the source of every E,
  so a seeded request draws the same numbers whatever else is in the batch
  and after preemption.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from pagoda.kernels import cpu_ops
from pagoda.kernels.cpu_ops import load_cpu_ops

_NO_PROBS = torch.empty(0)


def _compiled(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled module, if it is built and the tensors are on the CPU."""
    if all(t.device.type == "cpu" for t in tensors):
        return load_cpu_ops()
    return None


# ------------------------------------------------------------------ sample


def sample_rows(
    logits: torch.Tensor,  # [rows, vocab] float32
    temperature: torch.Tensor,  # [rows] float32; 0: greedy
    top_k: torch.Tensor,  # [rows] int64; 0 (or >= vocab): off
    top_p: torch.Tensor,  # [rows] float32; 1: off
    min_p: torch.Tensor,  # [rows] float32; 0: off
    seeds: torch.Tensor,  # [rows] int64: each row's Philox key ...
    counters: torch.Tensor,  # [rows] int64: ... and counter (draw i at (counter, i))
    probs_out: torch.Tensor | None = None,  # [rows, vocab] float32: the kept distributions
) -> torch.Tensor:
    """One token id per row (int64 [rows]).

    Top-p without top-k is drawn by rejection in the compiled op (a race
    among the tokens above a pivot, repeated while the winner lies outside
    the nucleus), so the op and the reference agree on those rows' tokens
    only in distribution. probs_out, when given, receives the kept
    distributions, worked out in full (slower; for tests)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError("expected logits [rows, vocab]")
    ops = _compiled(logits) if logits.dtype == torch.float32 else None
    if ops is not None:
        probs = _NO_PROBS if probs_out is None else probs_out
        return cpu_ops._run(
            ops,
            "sample_rows",
            logits.contiguous(),
            temperature.to(torch.float32).contiguous(),
            top_k.to(torch.int64).contiguous(),
            top_p.to(torch.float32).contiguous(),
            min_p.to(torch.float32).contiguous(),
            seeds.to(torch.int64).contiguous(),
            counters.to(torch.int64).contiguous(),
            probs,
        )
    return sample_rows_reference(
        logits, temperature, top_k, top_p, min_p, seeds, counters, probs_out
    )


def filtered_probs_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The distribution each sampled row draws from, [rows, vocab] float64
    (greedy rows: one-hot at the argmax)."""
    logits = logits.to(torch.float64)
    rows, vocab = logits.shape
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature.to(torch.float64))[:, None]
    probs = torch.softmax(scaled, dim=-1)  # [rows, vocab]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).to(torch.int64)
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    kth = ordered.gather(1, (k - 1)[:, None])  # [rows, 1]
    keep = probs >= kth  # top-k, ties with the k-th value kept
    kept = torch.where(keep, probs, 0.0)
    ordered_kept = kept.gather(1, order)
    total = ordered_kept.sum(dim=-1, keepdim=True)
    before = ordered_kept.cumsum(dim=-1) - ordered_kept  # mass before each token, in order
    in_p = (before < top_p.to(torch.float64)[:, None] * total) | (top_p[:, None] >= 1.0)
    in_p[:, 0] = True
    keep &= torch.zeros_like(keep).scatter_(1, order, in_p)
    keep &= probs >= min_p.to(torch.float64)[:, None] * probs.max(dim=-1, keepdim=True).values
    out = torch.where(keep, probs, 0.0)
    out = out / out.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(out).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, out)


def sample_rows_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    probs_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """sample_rows in plain torch: the two-level race over
    filtered_probs_reference's kept tokens."""
    probs = filtered_probs_reference(logits.cpu(), temperature, top_k, top_p, min_p)
    raced = _two_level_race(probs.numpy(), seeds.numpy(), counters.numpy())
    token_ids = torch.where(temperature == 0, probs.argmax(dim=-1), torch.from_numpy(raced))
    if probs_out is not None:
        probs_out.copy_(probs)
    return token_ids.to(logits.device)


SAMPLE_BLOCK = 256  # tokens per block of the two-level race
_BLOCK_INDEX = 0x80000000  # block indices are told apart from token ids by the top bit


def _race(
    weights: np.ndarray, seeds: np.ndarray, counters: np.ndarray, ids: np.ndarray
) -> np.ndarray:
    """Per row, the column of the winner of argmax weight / E, E ~ Exp(1) keyed by
    (seed, counter, round 0, id); weights and ids [rows, n]."""
    u = _philox_uniforms(seeds[:, None], counters[:, None], 0, ids)
    return np.argmax(weights / -np.log1p(-u), axis=1)


def _two_level_race(probs: np.ndarray, seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Winners of the race among blocks by their sums, then in the winning block."""
    rows, vocab = probs.shape
    num_blocks = -(-vocab // SAMPLE_BLOCK)
    padded = np.zeros((rows, num_blocks * SAMPLE_BLOCK))
    padded[:, :vocab] = probs
    blocks = padded.reshape(rows, num_blocks, SAMPLE_BLOCK)  # [rows, blocks, block]
    block_ids = np.broadcast_to(np.arange(num_blocks) | _BLOCK_INDEX, (rows, num_blocks))
    chosen = _race(blocks.sum(axis=2), seeds, counters, block_ids)  # [rows]
    weights = blocks[np.arange(rows), chosen]  # [rows, block]
    # E only for the kept tokens of the winning blocks.
    row, col = np.nonzero(weights > 0)
    u = _philox_uniforms(seeds[row], counters[row], 0, chosen[row] * SAMPLE_BLOCK + col)
    scores = np.full(weights.shape, -1.0)
    scores[row, col] = weights[row, col] / -np.log1p(-u)
    return chosen * SAMPLE_BLOCK + np.argmax(scores, axis=1)


# --------------------------------------------------------------- penalties


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab] float32, changed in place
    rows: torch.Tensor,  # [n] int64: the penalized rows of logits
    history: torch.Tensor,  # [slots, width] int32: token ids, prompt first
    slots: torch.Tensor,  # [n] int64: each penalized row's history row
    prompt_lens: torch.Tensor,  # [n] int64
    lens: torch.Tensor,  # [n] int64: prompt + output tokens in the history row
    repetition: torch.Tensor,  # [n] float32
    frequency: torch.Tensor,  # [n] float32
    presence: torch.Tensor,  # [n] float32
) -> None:
    """Repetition, frequency and presence penalties, in place."""
    args = (rows, history, slots, prompt_lens, lens, repetition, frequency, presence)
    ops = _compiled(logits, history) if logits.dtype == torch.float32 else None
    if ops is not None and logits.is_contiguous():
        cpu_ops._run(ops, "apply_penalties", logits, *args)
        return
    apply_penalties_reference(logits, *args)


def apply_penalties_reference(
    logits: torch.Tensor,
    rows: torch.Tensor,
    history: torch.Tensor,
    slots: torch.Tensor,
    prompt_lens: torch.Tensor,
    lens: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """apply_penalties in plain torch: per-row counts by one scatter-add."""
    n, vocab = rows.numel(), logits.shape[1]
    if n == 0:
        return
    ids = history[slots].to(torch.int64)  # [n, width]
    positions = torch.arange(ids.shape[1])[None, :]
    valid = (positions < lens[:, None]) & (ids >= 0) & (ids < vocab)
    is_output = valid & (positions >= prompt_lens[:, None])
    ids = torch.where(valid, ids, 0)
    counts = torch.zeros(n, vocab, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, ids, is_output.to(logits.dtype))
    occurrences = torch.zeros(n, vocab, dtype=torch.int32, device=logits.device)
    seen = occurrences.scatter_add_(1, ids, valid.to(torch.int32)) > 0
    sub = logits[rows]
    rep = repetition[:, None].to(logits.dtype)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
    logits[rows] = sub


# ------------------------------------------------------------------ Philox

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10 of uint32 counters [n, 4] under uint32 keys [n, 2] (numpy)."""
    c = counter.astype(np.uint64)
    k0, k1 = key[:, 0].astype(np.uint64), key[:, 1].astype(np.uint64)
    for _ in range(10):
        p0, p1 = _M0 * c[:, 0], _M1 * c[:, 2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c = np.stack([hi1 ^ c[:, 1] ^ k0, lo1, hi0 ^ c[:, 3] ^ k1, lo0], axis=1)
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c.astype(np.uint32)


def _philox_uniforms(
    seeds: np.ndarray | int, counters: np.ndarray | int, round_: int, indices: np.ndarray
) -> np.ndarray:
    """Uniforms in [0, 1) keyed by each seed at (counter, round_, index), broadcast."""
    s = np.asarray(seeds, dtype=np.int64).view(np.uint64)
    c = np.asarray(counters, dtype=np.int64).view(np.uint64)
    s, c, i = np.broadcast_arrays(s, c, np.asarray(indices, dtype=np.uint64))
    ctr = np.stack([c & _MASK32, c >> np.uint64(32), np.full_like(c, round_), i], axis=-1)
    key = np.stack([s & _MASK32, s >> np.uint64(32)], axis=-1)
    shape = s.shape
    out = philox4x32_10(ctr.reshape(-1, 4).astype(np.uint32), key.reshape(-1, 2).astype(np.uint32))
    out = out.astype(np.uint64)
    bits = (out[:, 0] << np.uint64(32)) | out[:, 1]
    return ((bits >> np.uint64(11)).astype(np.float64) * 2.0**-53).reshape(shape)


def philox_uniforms_reference(seeds: list[int], counters: list[int]) -> torch.Tensor:
    """philox_uniforms in numpy."""
    indices = np.zeros(len(seeds), dtype=np.uint64)
    return torch.from_numpy(_philox_uniforms(np.array(seeds), np.array(counters), 0, indices))


def philox_uniforms(seeds: list[int], counters: list[int]) -> torch.Tensor:
    """A uniform in [0, 1) per (seed, counter), at round 0 and index 0, float64 [n]."""
    ops = load_cpu_ops()
    if ops is None:
        return philox_uniforms_reference(seeds, counters)
    return cpu_ops._run(
        ops,
        "philox_uniforms",
        torch.tensor(seeds, dtype=torch.int64),
        torch.tensor(counters, dtype=torch.int64),
    )
