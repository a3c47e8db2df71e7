"""Experts split over data-parallel engine cores: the MoE exchange between
ranks (all-gather and all-to-all) against the op on one rank with every expert,
on random inputs with unequal token counts (an idle rank among them)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from pagoda.engine_core.models.moe import MoELayer, fused_moe, route
from pagoda.engine_core.worker.expert_parallel import (
    EXCHANGES,
    ExpertExchange,
    idle_pass,
    join_world,
)

EXPERTS, HIDDEN, INTER, TOP_K = 8, 64, 32, 2
COUNTS = {0: (5, 0, 17), 1: (9, 3, 0)}  # tokens per rank, three calls (one idle each)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    router = torch.randn(EXPERTS, HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 8).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 8).to(dtype)
    return router, w13, w2


def _tokens(rank: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + call)
    return torch.randn(COUNTS[rank][call], HIDDEN, generator=g).to(dtype)


def _rank(rank: int, port: int, failures: object) -> None:
    torch.set_num_threads(1)
    join_world(rank, 2, "127.0.0.1", port, 60)
    share = EXPERTS // 2
    mine = slice(rank * share, (rank + 1) * share)
    for dtype in (torch.float32, torch.bfloat16):
        router, w13, w2 = _weights(dtype)
        for kind in EXCHANGES:
            layer = MoELayer(router, w13[mine], w2[mine], TOP_K, True, first_expert=mine.start)
            layer.ep = ExpertExchange(rank, 2, kind)
            for call in range(3):
                x = _tokens(rank, call, dtype)
                got = layer(x).float()
                weights, ids = route(x, router, TOP_K, True)
                want = fused_moe(x, w13, w2, weights, ids).float()
                tolerance = 1e-5 if dtype == torch.float32 else 5e-2
                if got.shape != want.shape:
                    failures.put(f"rank {rank} {kind} {dtype} call {call}: {got.shape}")  # type: ignore[attr-defined]
                    continue
                if not len(x):
                    continue
                error = (got - want).abs().max().item()
                if error > tolerance * max(want.abs().max().item(), 1):
                    failures.put(f"rank {rank} {kind} {dtype} call {call}: {error}")  # type: ignore[attr-defined]
            # An idle pass joins the other rank's call with no tokens of its own.
            if rank == 0:
                idle_pass([type("L", (), {"moe": layer})()])
            else:
                x = _tokens(rank, 0, dtype)
                weights, ids = route(x, router, TOP_K, True)
                want = fused_moe(x, w13, w2, weights, ids).float()
                if (layer(x).float() - want).abs().max().item() > 5e-2 * max(
                    want.abs().max().item(), 1
                ):
                    failures.put(f"rank 1 {kind} {dtype}: wrong while the other rank idled")  # type: ignore[attr-defined]
    assert ExpertExchange(rank, 2).any_work(rank == 1)  # one busy rank: both see work
    assert not ExpertExchange(rank, 2).any_work(False)
    torch.distributed.destroy_process_group()


def test_exchanges_match_one_rank_with_every_expert() -> None:
    os.environ.pop("PAGODA_EP_EXCHANGE", None)
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    mp.spawn(_rank, args=(_free_port(), failures), nprocs=2, join=True)
    found = []
    while not failures.empty():
        found.append(failures.get())
    assert not found, found


def test_unknown_exchange_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.engine_core.worker.expert_parallel import exchange_kind

    monkeypatch.setenv("PAGODA_EP_EXCHANGE", "carrier-pigeon")
    with pytest.raises(ValueError, match="allgather, alltoall"):
        exchange_kind()
