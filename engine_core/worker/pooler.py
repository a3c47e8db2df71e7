"""Pooling: hidden states of a sequence → one vector (mean / CLS / last, L2-normalized)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_padded(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """Pool padded hidden states [batch, max_len, hidden] over each sequence's real tokens."""
    lens = torch.tensor(seq_lens, device=hidden.device)
    if pooling_type == "CLS":
        return hidden[:, 0]
    if pooling_type == "LAST":
        return hidden[torch.arange(len(seq_lens), device=hidden.device), lens - 1]
    # MEAN over the real tokens, special tokens included (as sentence-transformers does)
    mask = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lens[:, None]
    return (hidden * mask[..., None]).sum(dim=1) / lens[:, None].to(hidden.dtype)


def pool_flat(
    hidden: torch.Tensor, starts: list[int], lens: list[int], pooling_type: str
) -> torch.Tensor:
    """Pool segments of flat hidden states [num_tokens, hidden] → [num_segments, hidden]."""
    rows = []
    for start, n in zip(starts, lens, strict=True):
        seg = hidden[start : start + n]  # [n, hidden]
        if pooling_type == "CLS":
            rows.append(seg[0])
        elif pooling_type == "LAST":
            rows.append(seg[-1])
        else:
            rows.append(seg.mean(dim=0))
    return torch.stack(rows)


def finish(pooled: torch.Tensor, normalize: list[bool]) -> list[bytes]:
    """float32, L2-normalized where asked; one little-endian float32 buffer per row."""
    pooled = pooled.float()
    flags = torch.tensor(normalize, device=pooled.device)
    if flags.any():
        pooled = torch.where(flags[:, None], F.normalize(pooled, p=2, dim=-1), pooled)
    # numpy's "<f4" pins the byte order whatever the host's is.
    array = pooled.cpu().numpy().astype("<f4")
    return [row.tobytes() for row in array]
