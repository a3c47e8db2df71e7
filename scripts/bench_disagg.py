"""A mixed load on the same machine two ways: two data-parallel engines, or one
prefill engine + one decode engine behind `pagoda proxy` (KV pulled with the
PeerConnector). Long prompts arrive at a fixed interval beside a steady set
of short chats; reported: the short chats' inter-token latency (p50, p99)
and TTFT, the long prompts' TTFT, and output tokens per second.

    python scripts/bench_disagg.py [--duration 60] [--rounds 2] [--threads 1]

Each engine gets --threads torch threads (the machine's cores split evenly);
prompts are random token ids (no prefix-cache hits), greedy, ignore_eos.
Configurations alternate round by round in one window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base: str, procs: list[subprocess.Popen[bytes]], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited while starting {base}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base} not healthy")


def start(argv: list[str], log_dir: Path, name: str) -> subprocess.Popen[bytes]:
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 (lives as long as the process)
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def serve_argv(port: int, threads: int, *extra: str) -> list[str]:
    return [
        PY, "-m", "pagoda.frontend.pagoda_cli", "serve", "--port", str(port),
        "--num-threads", str(threads), "--max-model-len", "2048", *extra,
    ]  # fmt: skip


def start_config(
    kind: str, threads: int, log_dir: Path
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    if kind == "dp2":
        port = free_port()
        procs.append(start(serve_argv(port, threads, "--data-parallel-size", "2"), log_dir, "dp"))
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, procs)
        return base, procs
    urls = []
    for role in ("kv_producer", "kv_consumer"):
        port = free_port()
        config = json.dumps({"kv_connector": "PeerConnector", "kv_role": role})
        argv = serve_argv(port, threads, "--kv-transfer-config", config)
        procs.append(start(argv, log_dir, role))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_healthy(url, procs)
    port = free_port()
    proxy = [PY, "-m", "pagoda.frontend.pagoda_cli", "proxy", "--port", str(port)]
    procs.append(start([*proxy, "--prefill", urls[0], "--decode", urls[1]], log_dir, "proxy"))
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, procs)
    return base, procs


async def one(
    client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    started = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
                tokens += 1
    ttft = arrivals[0] - started if arrivals else float("nan")
    itl = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft": ttft, "itl": itl, "chunks": tokens}


async def run_load(base: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    short: list[dict[str, Any]] = []
    long: list[dict[str, Any]] = []
    stop_at = time.perf_counter() + args.duration
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # Warm up both paths.
        await one(client, base, prompt(args.long_len), 2)

        async def chat_loop() -> None:
            while time.perf_counter() < stop_at:
                short.append(await one(client, base, prompt(args.short_len), args.short_out))

        async def long_arrivals() -> None:
            tasks = []
            while time.perf_counter() < stop_at:
                tasks.append(
                    asyncio.create_task(one(client, base, prompt(args.long_len), args.long_out))
                )
                await asyncio.sleep(args.long_interval)
            long.extend(await asyncio.gather(*tasks))

        started = time.perf_counter()
        await asyncio.gather(long_arrivals(), *(chat_loop() for _ in range(args.short_concurrency)))
        elapsed = time.perf_counter() - started
    itl = sorted(x for r in short for x in r["itl"])

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(int(q * len(values)), len(values) - 1)] * 1000 if values else float("nan")

    out_tokens = sum(r["chunks"] for r in short + long)
    return {
        "short_requests": len(short),
        "short_itl_p50_ms": round(pct(itl, 0.5), 1),
        "short_itl_p99_ms": round(pct(itl, 0.99), 1),
        "short_ttft_p50_ms": round(pct([r["ttft"] for r in short], 0.5), 1),
        "long_requests": len(long),
        "long_ttft_p50_ms": round(pct([r["ttft"] for r in long], 0.5), 1),
        "long_ttft_p99_ms": round(pct([r["ttft"] for r in long], 0.99), 1),
        "output_tok_s": round(out_tokens / elapsed, 1),
    }


def transfer_figures(procs: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    """The decode engine's KV transfer counters: per request, bytes and time."""
    decode_url = _decode_url(procs)
    text = httpx.get(f"{decode_url}/metrics", timeout=10).text

    def value(name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    n = value("pagoda:kv_transfers_total") or 1.0
    return {
        "kv_transfers": int(value("pagoda:kv_transfers_total")),
        "kv_recomputed": int(value("pagoda:kv_recomputed_total")),
        "kv_mb_per_request": round(value("pagoda:kv_transfer_bytes_total") / n / 1e6, 2),
        "kv_ms_per_request": round(value("pagoda:kv_transfer_seconds_total") / n * 1000, 1),
    }


def _decode_url(procs: list[subprocess.Popen[bytes]]) -> str:
    argv = [str(a) for a in procs[1].args]  # type: ignore[union-attr]
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max((os.cpu_count() or 2) // 2, 1))
    parser.add_argument("--short-concurrency", type=int, default=6)
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--short-out", type=int, default=128)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--long-out", type=int, default=64)
    parser.add_argument("--long-interval", type=float, default=5.0)
    parser.add_argument("--configs", default="dp2,pd", help="dp2 and/or pd, in round order")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    print(f"logs in {log_dir}", file=sys.stderr)
    results: dict[str, list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        for kind in args.configs.split(","):
            base, procs = start_config(kind, args.threads, log_dir)
            try:
                result = asyncio.run(run_load(base, args, seed=round_index))
                if kind == "pd":
                    result.update(transfer_figures(procs))
            finally:
                stop(procs)
            results.setdefault(kind, []).append(result)
            print(json.dumps({"config": kind, "round": round_index, **result}), flush=True)
    for kind, rows in results.items():
        summary = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
        print(json.dumps({"config": kind, "median_of_rounds": summary}), flush=True)


if __name__ == "__main__":
    main()
