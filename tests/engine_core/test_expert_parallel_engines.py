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
    shared_memory_exchange,
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
    shm = shared_memory_exchange(rank, 2, str(port), 32, HIDDEN, torch.device("cpu"))
    if shm is None:
        failures.put("no shared-memory exchange on this host")  # type: ignore[attr-defined]
    share = EXPERTS // 2
    mine = slice(rank * share, (rank + 1) * share)
    for dtype in (torch.float32, torch.bfloat16):
        router, w13, w2 = _weights(dtype)
        for kind in EXCHANGES:
            layer = MoELayer(router, w13[mine], w2[mine], TOP_K, True, first_expert=mine.start)
            layer.ep = ExpertExchange(rank, 2, kind, shm=shm if kind == "shm" else None)
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
    if rank == 1:
        # Gone, as a killed engine is (no teardown): rank 0's next shared-memory
        # wait must fail, not spin forever.
        shm.close()
        failures.close()  # type: ignore[attr-defined]
        failures.join_thread()  # type: ignore[attr-defined]
        os._exit(0)
    try:
        shm.exchange_rows(torch.zeros(1, HIDDEN))
        failures.put("waited for a rank that is gone and got an answer")  # type: ignore[attr-defined]
    except RuntimeError as e:
        if "gone" not in str(e):
            failures.put(f"the wrong error: {e}")  # type: ignore[attr-defined]
    shm.close()
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


def test_what_cannot_be_split_over_engines_is_refused(tmp_path: object) -> None:
    from pathlib import Path

    from pagoda.engine_core.config import EngineConfig
    from pagoda.engine_core.model_config import load_model_config
    from pagoda.engine_core.worker.parallel import check_expert_parallel_engines
    from tests.engine_core.test_moe import build

    assert isinstance(tmp_path, Path)
    mixtral = load_model_config(str(build("mixtral", tmp_path / "mixtral")))  # 6 experts
    ok = EngineConfig(enable_expert_parallel=True, data_parallel_size=2)
    assert ok.expert_parallel_engines
    check_expert_parallel_engines(mixtral, ok)
    with pytest.raises(ValueError, match="6 experts do not divide by --data-parallel-size 4"):
        check_expert_parallel_engines(
            mixtral, EngineConfig(enable_expert_parallel=True, data_parallel_size=4)
        )
    with pytest.raises(ValueError, match="one rank"):
        check_expert_parallel_engines(
            mixtral,
            EngineConfig(enable_expert_parallel=True, data_parallel_size=2, tensor_parallel_size=2),
        )


def test_the_command_lines_refuse_what_does_not_fit() -> None:
    import subprocess
    import sys

    engine = subprocess.run(
        [sys.executable, "-m", "pagoda.engine_core.cli", "--data-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert engine.returncode == 2 and "--data-parallel-rank in [0, 2)" in engine.stderr
    # The default model is dense: its engines refuse, and pagoda serve stops.
    serve = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.frontend.pagoda_cli",
            "serve",
            "--enable-expert-parallel",
            "--data-parallel-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert serve.returncode != 0 and "needs a mixture-of-experts model" in serve.stderr
