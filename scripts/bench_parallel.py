"""What running on several ranks costs per step, on this host.

1. The mp executor's channel: a step's plan (NUM cached decode requests, the
   shape of a steady batch) encoded with msgpack, sent over ZeroMQ ipc to a
   worker process, decoded there, and a StepResult of NUM sampled tokens sent
   back and decoded: the round trip the engine pays per step on top of the
   model, measured against an echoing worker.
2. The tensor-parallel collectives at decode sizes: all-reduce of [rows,
   hidden] (two per layer) over gloo and through shared memory
   (engine_core/worker/shm_allreduce.py), and all-gather of the head's
   [rows, vocab / 2] float32 logits over gloo, between 2 processes.

    python scripts/bench_parallel.py                     # both, batch 64, the default model's sizes
    python scripts/bench_parallel.py --rows 1 --hidden 576

`--make-model DIR` writes a random Llama of the default model's size whose
heads divide by 2 (hidden 512: 8 heads of 64, 4 KV heads; 30 layers, MLP
1536, the default model's vocabulary and tokenizer), for W1 at one and two
ranks: `python scripts/bench_throughput.py --no-hf --model DIR -tp 2`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from pagoda.engine_core.core.plan import CachedRequestData, SchedulePlan, StepResult

_ECHO = """
import sys, msgspec, zmq
from pagoda.engine_core.core.plan import SchedulePlan, StepResult
ctx = zmq.Context(); inbox = ctx.socket(zmq.PULL); inbox.connect(sys.argv[1] + "/in")
out = ctx.socket(zmq.PUSH); out.connect(sys.argv[1] + "/out")
plans = msgspec.msgpack.Decoder(SchedulePlan)
while True:
    kind, payload = inbox.recv_multipart()
    if kind == b"stop":
        break
    plan = plans.decode(payload)
    result = StepResult(sampled_token_ids={r: 7 for r in plan.num_scheduled_tokens})
    out.send_multipart([b"0", b"ok", msgspec.msgpack.encode(result)])
"""


def channel(num: int, steps: int) -> list[float]:
    """Round-trip seconds per step, plan out and result back."""
    directory = tempfile.mkdtemp(prefix="pagoda-bench-")
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.bind(f"ipc://{directory}/in")
    back = ctx.socket(zmq.PULL)
    back.bind(f"ipc://{directory}/out")
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, f"ipc://{directory}"])
    times = []
    try:
        for step in range(steps + 20):
            plan = SchedulePlan(
                new_requests=[],
                cached_requests=[
                    CachedRequestData(
                        request_id=f"cmpl-{i:032x}",
                        new_block_ids=[1000 + i] if step % 16 == 0 else [],
                        num_computed_tokens=128 + step,
                    )
                    for i in range(num)
                ],
                num_scheduled_tokens={f"cmpl-{i:032x}": 1 for i in range(num)},
            )
            started = time.perf_counter()
            out.send_multipart([b"execute", msgspec.msgpack.encode(plan)])
            _, _, payload = back.recv_multipart()
            msgspec.msgpack.decode(payload, type=StepResult)
            if step >= 20:  # warm-up
                times.append(time.perf_counter() - started)
        out.send_multipart([b"stop", b""])
        echo.wait(10)
    finally:
        if echo.poll() is None:
            echo.kill()
        ctx.destroy(linger=0)
    return times


_COLLECTIVES = """
import sys, time, torch, torch.distributed as dist
rank, port, rows, hidden, vocab, reps = (int(a) for a in sys.argv[1:7])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
from pagoda.engine_core.worker.shm_allreduce import SharedMemoryAllReduce
shm = SharedMemoryAllReduce(rank, 2, f"pagoda-bench-{port}")
out = {}
for name, tensor, op in [
    ("gloo all_reduce bf16 [rows, hidden]", torch.randn(rows, hidden).bfloat16(), "reduce"),
    ("gloo all_reduce f32 [rows, hidden]", torch.randn(rows, hidden), "reduce"),
    ("shm all_reduce bf16 [rows, hidden]", torch.randn(rows, hidden).bfloat16(), "shm"),
    ("shm all_reduce f32 [rows, hidden]", torch.randn(rows, hidden), "shm"),
    ("gloo all_gather f32 [rows, vocab/2]", torch.randn(rows, vocab // 2), "gather"),
    ("shm all_gather f32 [rows, vocab/2]", torch.randn(rows, vocab // 2), "shm_gather"),
    ("gloo send/recv bf16 [2, rows, hidden] (stage to stage)",
     torch.randn(2, rows, hidden).bfloat16(), "p2p"),
]:
    parts = [torch.empty_like(tensor) for _ in range(2)]
    times = []
    for i in range(reps + 10):
        dist.barrier()
        t = time.perf_counter()
        if op == "reduce":
            dist.all_reduce(tensor)
        elif op == "shm":
            assert shm.all_reduce(tensor)
        elif op == "p2p":
            if rank == 0:
                dist.send(tensor, dst=1)
            else:
                dist.recv(tensor, src=0)
        elif op == "shm_gather":
            assert shm.all_gather_last(tensor) is not None
        else:
            dist.all_gather(parts, tensor)
        if i >= 10:
            times.append(time.perf_counter() - t)
    times.sort()
    out[name] = times[len(times) // 2]
if rank == 0:
    for name, t in out.items():
        print(f"{name}: {t * 1e6:.0f} us (median of {reps})")
dist.destroy_process_group()
"""


def collectives(rows: int, hidden: int, vocab: int, reps: int) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [str(a) for a in (port, rows, hidden, vocab, reps)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _COLLECTIVES, str(rank), *args])
        for rank in range(2)
    ]
    for proc in procs:
        proc.wait(300)


def make_model(directory: str) -> None:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagoda.engine_core.model_config import default_model_path
    from pagoda.engine_core.tokenizer_files import tokenizer_dir_for

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    tokenizer = Path(tokenizer_dir_for(default_model_path()))
    for file in tokenizer.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, directory)
    print(f"wrote {directory}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="requests in the step")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--no-collectives", action="store_true")
    parser.add_argument("--make-model", metavar="DIR", help="write the benchmark model and stop")
    args = parser.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return
    times = channel(args.rows, args.steps)
    print(
        f"mp channel, {args.rows} requests a step: median {statistics.median(times) * 1e6:.0f} us,"
        f" p90 {sorted(times)[int(len(times) * 0.9)] * 1e6:.0f} us a step"
        f" (cpu count {os.cpu_count()})"
    )
    if not args.no_collectives:
        collectives(args.rows, args.hidden, args.vocab, 200)


if __name__ == "__main__":
    main()
