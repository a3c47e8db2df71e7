"""Statistical checks shared by the sampling tests."""

from __future__ import annotations

import torch


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs: the p-value. Bins
    expecting fewer than 5 draws are pooled into one."""
    n = int(counts.sum())
    expected = probs.double() * n
    big = expected >= 5
    observed, exp = counts[big].double(), expected[big]
    if float(expected[~big].sum()) > 0:
        observed = torch.cat([observed, counts[~big].sum().double()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    stat = float(((observed - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
