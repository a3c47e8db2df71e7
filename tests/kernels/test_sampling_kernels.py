"""The sampling kernels against their plain-torch references (kernels/sampling.py).

The compiled op must keep exactly the distribution the reference defines
(top-k with ties, top-p over top-k, min-p), pick the same winner of the
same two-level race, and never leave that support on its rejection path;
Philox must give Random123's known answers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.kernels import sampling
from pagoda.kernels.cpu_ops import load_cpu_ops
from tests.statistics import chi_square_p

needs_ops = pytest.mark.skipif(load_cpu_ops() is None, reason="no compiled CPU kernels")


def test_philox_known_answers() -> None:
    # Random123's kat_vectors for philox4x32_10.
    counters = np.array(
        [[0, 0, 0, 0], [0xFFFFFFFF] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]],
        dtype=np.uint32,
    )
    keys = np.array([[0, 0], [0xFFFFFFFF] * 2, [0xA4093822, 0x299F31D0]], dtype=np.uint32)
    expected = [
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ]
    assert sampling.philox4x32_10(counters, keys).tolist() == expected


@needs_ops
def test_compiled_philox_matches_numpy() -> None:
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (200,), generator=g).tolist() + [0, -1, 2**63 - 1]
    counters = torch.randint(0, 2**62, (200,), generator=g).tolist() + [0, 1, 2**40]
    got = sampling.philox_uniforms(seeds, counters)
    want = sampling.philox_uniforms_reference(seeds, counters)
    assert torch.equal(got, want)
    assert 0.0 <= float(got.min()) and float(got.max()) < 1.0
    assert 0.4 < float(got.mean()) < 0.6


# (temperature, top_k, top_p, min_p): every path of the compiled op.
SETTINGS = [
    (0.0, 0, 1.0, 0.0),  # greedy
    (1.0, 0, 1.0, 0.0),  # the two-level race over the whole row
    (0.7, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.05),  # min-p folded into the weights
    (0.8, 0, 0.95, 0.0),  # top-p by rejection
    (1.3, 0, 0.5, 0.02),  # top-p and min-p
    (1.0, 1, 1.0, 0.0),  # top-1
    (1.0, 20, 1.0, 0.0),  # top-k under the number of blocks
    (1.0, 50, 0.9, 0.0),  # top-k and top-p
    (0.9, 300, 1.0, 0.1),  # top-k over the maxima of 16 entries
    (1.0, 40_000, 0.8, 0.0),  # top-k past those: every entry a candidate
    (1.0, 10**9, 1.0, 0.0),  # top-k beyond the vocabulary: off
    (2.0, 0, 1e-6, 0.0),  # top-p keeps the maximum alone
    (1e-4, 0, 1.0, 0.0),  # near-zero temperature
    (100.0, 7, 0.99, 0.0),
    (1.0, 0, 1.0, 1.0),  # min-p 1: the maximum alone
]


def settings_tensors(rows: list[tuple[float, int, float, float]]) -> tuple[torch.Tensor, ...]:
    t, k, p, m = zip(*rows, strict=True)
    return (
        torch.tensor(t, dtype=torch.float32),
        torch.tensor(k, dtype=torch.int64),
        torch.tensor(p, dtype=torch.float32),
        torch.tensor(m, dtype=torch.float32),
    )


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3.0
    logits[::3, : vocab // 4] = float("-inf")  # masked entries, as a grammar leaves them
    return logits


@needs_ops
@pytest.mark.parametrize("vocab", [1000, 49152])
def test_kept_distribution_matches_reference(vocab: int) -> None:
    rows = SETTINGS * 2
    logits = random_logits(len(rows), vocab, seed=vocab)
    t, k, p, m = settings_tensors(rows)
    seeds = torch.arange(len(rows), dtype=torch.int64)
    counters = torch.zeros(len(rows), dtype=torch.int64)
    probs = torch.empty(len(rows), vocab)
    sampling.sample_rows(logits, t, k, p, m, seeds, counters, probs)
    want = sampling.filtered_probs_reference(logits, t, k, p, m)
    assert torch.equal(probs > 0, want > 0)
    torch.testing.assert_close(probs.double(), want, atol=2e-6, rtol=1e-4)


@needs_ops
@pytest.mark.parametrize("vocab", [777, 49152])
def test_tokens_match_reference_race(vocab: int) -> None:
    rows = SETTINGS * 8
    logits = random_logits(len(rows), vocab, seed=7 + vocab)
    t, k, p, m = settings_tensors(rows)
    g = torch.Generator().manual_seed(1)
    seeds = torch.randint(-(2**63), 2**63 - 1, (len(rows),), generator=g)
    counters = torch.randint(0, 1000, (len(rows),), generator=g)
    got = sampling.sample_rows(logits, t, k, p, m, seeds, counters)
    want = sampling.sample_rows_reference(logits, t, k, p, m, seeds, counters)
    kept = sampling.filtered_probs_reference(logits, t, k, p, m)
    # Top-p without top-k races among the tokens above a pivot, round by round.
    rejection = (p < 1.0) & ~((k > 0) & (k < vocab)) & (t > 0)
    assert torch.equal(got[~rejection], want[~rejection])
    assert bool((kept.gather(1, got[:, None]) > 0).all())


@needs_ops
@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_rejection_draws_follow_the_nucleus(top_p: float) -> None:
    """Top-p by rejection on a full vocabulary: never outside the nucleus,
    and in proportion to p inside it (chi-square)."""
    vocab, draws = 49152, 3000
    g = torch.Generator().manual_seed(5)
    row = torch.randn(vocab, generator=g) * 2.0
    row[:40] += 6.0  # a head of likely tokens above a long tail
    logits = row.expand(draws, vocab).contiguous()
    t, k, p, m = settings_tensors([(1.0, 0, top_p, 0.0)] * draws)
    seeds = torch.arange(draws, dtype=torch.int64)
    got = sampling.sample_rows(logits, t, k, p, m, seeds, torch.zeros(draws, dtype=torch.int64))
    want = sampling.filtered_probs_reference(logits[:1], t[:1], k[:1], p[:1], m[:1])[0]
    counts = torch.bincount(got, minlength=vocab)
    assert int(counts[want == 0].sum()) == 0
    assert chi_square_p(counts, want) > 1e-3


@needs_ops
def test_seeded_rows_do_not_depend_on_their_neighbours() -> None:
    vocab = 5000
    logits = random_logits(len(SETTINGS), vocab, seed=11)
    t, k, p, m = settings_tensors(SETTINGS)
    seeds = torch.arange(100, 100 + len(SETTINGS), dtype=torch.int64)
    counters = torch.full((len(SETTINGS),), 17, dtype=torch.int64)
    alone = torch.cat(
        [
            sampling.sample_rows(
                logits[i : i + 1], t[i : i + 1], k[i : i + 1], p[i : i + 1], m[i : i + 1],
                seeds[i : i + 1], counters[i : i + 1],
            )
            for i in range(len(SETTINGS))
        ]
    )  # fmt: skip
    order = torch.randperm(len(SETTINGS), generator=torch.Generator().manual_seed(0))
    shuffled = sampling.sample_rows(
        logits[order], t[order], k[order], p[order], m[order], seeds[order], counters[order]
    )
    assert torch.equal(shuffled, alone[order])
    # Another counter (the next token) draws anew.
    later = sampling.sample_rows(logits, t, k, p, m, seeds, counters + 1)
    assert not torch.equal(later, alone)


@needs_ops
def test_edge_rows() -> None:
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    logits[0] = float("-inf")
    logits[0, 123] = 0.5  # one token left by a mask
    logits[1] = float("-inf")  # nothing left: the argmax, as greedy
    logits[2] = 1.0  # all tied: top-k keeps the ties
    logits[3, 10] = float("nan")  # a NaN weighs nothing
    t, k, p, m = settings_tensors(
        [(1.0, 5, 0.9, 0.0), (1.0, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 1.0, 0.0)]
        + [(1.0, 0, 1.0, 0.0)] * 2
    )
    seeds = torch.arange(6, dtype=torch.int64)
    probs = torch.empty(6, vocab)
    got = sampling.sample_rows(logits, t, k, p, m, seeds, torch.zeros(6, dtype=torch.int64), probs)
    assert got[0] == 123 and got[1] == 0
    assert int((probs[2] > 0).sum()) == vocab  # ties with the 3rd value stay
    assert got[3] != 10 and probs[3, 10] == 0
    with pytest.raises(RuntimeError, match="top_k"):
        sampling.sample_rows(logits, t, k[:2], p, m, seeds, seeds)


@needs_ops
def test_penalties_match_reference() -> None:
    vocab, n, width = 4000, 12, 300
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(20, vocab, generator=g) * 4
    history = torch.randint(0, vocab, (16, width), generator=g, dtype=torch.int32)
    history[3, 5] = vocab + 7  # an id outside the vocabulary is skipped
    history[4, :50] = 17  # one token many times
    rows = torch.randperm(20, generator=g)[:n]
    slots = torch.randperm(16, generator=g)[:n]
    lens = torch.randint(0, width + 1, (n,), generator=g)
    prompt_lens = (lens.double() * torch.rand(n, generator=g)).long()
    rep = torch.rand(n, generator=g) + 0.5
    freq = torch.rand(n, generator=g) * 4 - 2
    pres = torch.rand(n, generator=g) * 4 - 2
    args = (rows, history, slots, prompt_lens, lens, rep, freq, pres)
    got, want = logits.clone(), logits.clone()
    sampling.apply_penalties(got, *args)
    sampling.apply_penalties_reference(want, *args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    assert not torch.equal(got, logits)
    with pytest.raises(RuntimeError, match="out of range"):
        sampling.apply_penalties(got, rows, history, slots, prompt_lens, lens + width, *args[5:])
