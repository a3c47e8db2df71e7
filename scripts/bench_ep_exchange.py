"""The MoE exchanges of expert parallelism across data-parallel engines
(engine_core/worker/expert_parallel.py), timed per MoE layer call between 2
processes on this host, against the layer without expert parallelism.

    python scripts/bench_ep_exchange.py                  # Qwen3-30B-A3B's layer sizes, bf16
    python scripts/bench_ep_exchange.py --hidden 64 --inter 32 --experts 8 --top-k 2

The exchanges: through shared memory ("shm"), and over gloo ("allgather",
"alltoall"). Each rank holds half of the experts; both send the same number of tokens per
call (--tokens, several values). Prints the median milliseconds of a layer
call with each exchange, and without expert parallelism ("every expert": both
processes at once, each computing its own tokens with all of the experts, as
two data-parallel engines that each hold the whole model do). Each process
runs --threads threads.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from functools import partial

import torch
import torch.multiprocessing as mp

from pagoda.engine_core.models.moe import MoELayer, fused_moe, route
from pagoda.engine_core.worker.expert_parallel import (
    EXCHANGES,
    ExpertExchange,
    join_world,
    shared_memory_exchange,
)

BASELINE = "every expert"


def layer_weights(args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    router = torch.randn(e, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    return router, w13, w2


def timed(fn: object, repeat: int) -> float:
    fn()  # type: ignore[operator]
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def rank_main(rank: int, port: int, args: argparse.Namespace, results: object) -> None:
    torch.set_num_threads(args.threads)
    join_world(rank, 2, "127.0.0.1", port, 300)
    dtype = getattr(torch, args.dtype)
    router, w13, w2 = layer_weights(args, dtype)
    half = args.experts // 2
    mine = slice(rank * half, (rank + 1) * half)
    layers = {
        kind: MoELayer(router, w13[mine], w2[mine], args.top_k, True, mine.start)
        for kind in EXCHANGES
    }
    shm = shared_memory_exchange(
        rank, 2, str(port), max(args.tokens), args.hidden, torch.device("cpu")
    )
    for kind, layer in layers.items():
        layer.ep = ExpertExchange(rank, 2, kind, shm=shm if kind == "shm" else None)
    for n in args.tokens:
        x = torch.randn(n, args.hidden, generator=torch.Generator().manual_seed(rank)).to(dtype)
        row = {"tokens": n}
        for kind, layer in layers.items():
            torch.distributed.barrier()
            row[kind] = timed(partial(layer, x), args.repeat)
        # Without expert parallelism: both ranks at once, each its own tokens
        # through every expert (two data-parallel engines that hold all of them).
        weights, ids = route(x, router, args.top_k, True)
        torch.distributed.barrier()
        row[BASELINE] = timed(partial(fused_moe, x, w13, w2, weights, ids), args.repeat)
        if rank == 0:
            results.put(row)  # type: ignore[attr-defined]
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.spawn(rank_main, args=(port, args, results), nprocs=2, join=True)
    print(f"{'tokens/rank':>11} " + " ".join(f"{k:>12}" for k in (*EXCHANGES, BASELINE)))
    while not results.empty():
        row = results.get()
        cells = " ".join(f"{row[k]:>9.2f} ms" for k in (*EXCHANGES, BASELINE))
        print(f"{row['tokens']:>11} {cells}")


if __name__ == "__main__":
    main()
