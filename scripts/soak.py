"""Soak Pagoda under a bounded mixed load with client cancellations, then check for leaks.

    python scripts/soak.py --requests 10000 --duration 600          # starts `pagoda serve`
    python scripts/soak.py --base-url http://127.0.0.1:8000 --pids 123 124

The load: streaming and not, short and long prompts, ~30% cancelled by the
client at a random point (mid-stream, or by closing the connection before the
answer), ~5% with structured output. It stops by itself after --requests or
--duration. At the end it checks that the engine has no running or waiting
request, that every KV block is free or cached (GET /stats, which runs the
block manager's check_invariants), that each process's RSS is within
--rss-tolerance of its value after warm-up, and that nothing failed but the
cancellations. It prints a summary and a JSON line; exit status 1 on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

_WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()


@dataclass
class SoakConfig:
    base_url: str
    pids: list[int]
    requests: int = 1000
    duration_s: float = 600.0
    concurrency: int = 16
    cancel_fraction: float = 0.3
    structured_fraction: float = 0.05
    warmup_requests: int = 16
    rss_tolerance: float = 0.10
    seed: int = 0


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    streamed: int = 0
    structured: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    final_stats: dict[str, Any] = field(default_factory=dict)
    leaked_blocks: int = -1
    rss_warm_mb: dict[str, float] = field(default_factory=dict)
    rss_end_mb: dict[str, float] = field(default_factory=dict)
    max_rss_drift: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _body(rng: random.Random, stream: bool, structured: bool) -> tuple[str, dict[str, Any]]:
    words = rng.choice((4, 16, 64, 200))
    prompt = " ".join(rng.choice(_WORDS) for _ in range(words))
    max_tokens = rng.choice((4, 8, 16, 32))
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.8, "stream": stream}
    if structured:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": "pick",
                "schema": {
                    "type": "object",
                    "properties": {"animal": {"enum": ["fox", "dog", "owl"]}},
                    "required": ["animal"],
                },
            },
        }
    if structured or rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


async def _one(
    client: httpx.AsyncClient, cfg: SoakConfig, rng: random.Random, report: SoakReport
) -> None:
    stream = rng.random() < 0.5
    structured = rng.random() < cfg.structured_fraction
    cancel = rng.random() < cfg.cancel_fraction
    path, body = _body(rng, stream, structured)
    report.requests += 1
    report.streamed += stream
    report.structured += structured
    try:
        if stream:
            stop_after = rng.randint(0, 6) if cancel else None
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread())[:200]
                    report.errors.append(f"{path} stream {r.status_code}: {text!r}")
                    return
                events = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        if '"error"' in line and line.startswith('data: {"error"'):
                            report.errors.append(f"{path} stream error event: {line[:200]}")
                        events += 1
                        if stop_after is not None and events > stop_after:
                            report.cancelled += 1
                            return  # leaving the block closes the connection mid-stream
            if stop_after is not None:
                report.cancelled += 1  # finished before the chosen point: still counted
            else:
                report.completed += 1
            return
        if cancel:
            try:
                await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.01, 1.0))
                report.completed += 1
            except TimeoutError:
                report.cancelled += 1
            return
        r = await client.post(path, json=body)
        if r.status_code != 200:
            report.errors.append(f"{path} {r.status_code}: {r.text[:200]}")
        else:
            report.completed += 1
    except httpx.HTTPError as e:
        report.errors.append(f"{path}: {type(e).__name__}: {e}")


async def _load(cfg: SoakConfig, n: int, deadline: float, report: SoakReport, seed: int) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=cfg.concurrency * 2)
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=120.0, limits=limits) as client:
        counter = iter(range(n))

        async def worker(wid: int) -> None:
            wrng = random.Random(rng.random() + wid)
            for _ in counter:
                if time.monotonic() > deadline:
                    return
                await _one(client, cfg, wrng, report)

        await asyncio.gather(*(worker(i) for i in range(cfg.concurrency)))


async def _settle(base_url: str, timeout: float = 60.0) -> dict[str, Any]:
    """GET /stats until nothing runs or waits (aborts of cancelled requests land)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        while True:
            stats: dict[str, Any] = (await client.get("/stats")).json()
            idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
            if (idle and stats["num_used_blocks"] == 0) or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.5)


async def soak(cfg: SoakConfig) -> SoakReport:
    report = SoakReport()
    warm = SoakReport()
    far = time.monotonic() + 3600
    # The first structured request builds the grammar compiler (seconds): do it here.
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=300.0) as client:
        path, body = _body(random.Random(cfg.seed), False, True)
        await client.post(path, json=body)
    await _load(cfg, cfg.warmup_requests, far, warm, cfg.seed + 1)
    await _settle(cfg.base_url)
    warm_rss = {pid: rss_bytes(pid) for pid in cfg.pids}
    start = time.monotonic()
    await _load(cfg, cfg.requests, start + cfg.duration_s, report, cfg.seed)
    report.seconds = time.monotonic() - start
    stats = await _settle(cfg.base_url)
    report.final_stats = stats
    # /stats ran check_invariants; a used block with nothing running is a leak
    # (cached prefix blocks count as free: they are evictable).
    report.leaked_blocks = int(stats["num_used_blocks"])
    end_rss = {pid: rss_bytes(pid) for pid in cfg.pids}
    for pid in cfg.pids:
        report.rss_warm_mb[str(pid)] = round(warm_rss[pid] / 2**20, 1)
        report.rss_end_mb[str(pid)] = round(end_rss[pid] / 2**20, 1)
        drift = (end_rss[pid] - warm_rss[pid]) / warm_rss[pid]
        report.max_rss_drift = max(report.max_rss_drift, drift)
    if stats["num_running"] or stats["num_waiting"]:
        report.failures.append(
            f"{stats['num_running']} running / {stats['num_waiting']} waiting at the end"
        )
    if report.leaked_blocks:
        report.failures.append(f"{report.leaked_blocks} KV blocks still in use at the end")
    if report.max_rss_drift > cfg.rss_tolerance:
        report.failures.append(f"RSS grew {report.max_rss_drift:.1%} after warm-up")
    if report.errors:
        report.failures.append(f"{len(report.errors)} errors, first: {report.errors[0]}")
    return report


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out += [int(k) for k in kids]
    return out


def _start_serve(port: int, extra: list[str]) -> tuple[subprocess.Popen[bytes], list[int]]:
    repo = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "pagoda.frontend.pagoda_cli", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), *extra]
    env = dict(os.environ, PYTHONPATH=str(repo))
    proc = subprocess.Popen(argv, cwd=repo, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("pagoda serve exited early")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, [proc.pid, *_children(proc.pid)]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("pagoda serve did not become healthy")


def print_report(report: SoakReport) -> None:
    print(f"requests {report.requests} in {report.seconds:.0f} s")
    print(f"  completed {report.completed}, cancelled by the client {report.cancelled}")
    print(f"  streamed {report.streamed}, structured output {report.structured}")
    print(f"  errors {len(report.errors)}, leaked KV blocks {report.leaked_blocks}")
    print(f"  RSS after warm-up {report.rss_warm_mb} MiB, at the end {report.rss_end_mb} MiB")
    print(f"  max RSS drift {report.max_rss_drift:+.1%}")
    print("PASS" if report.ok else f"FAIL: {'; '.join(report.failures)}")
    print(json.dumps({**asdict(report), "errors": report.errors[:20], "ok": report.ok}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", help="a running server (else `pagoda serve` is started)")
    parser.add_argument("--pids", type=int, nargs="*", default=[], help="processes to watch")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds, at most")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cancel-fraction", type=float, default=0.3)
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument(
        "--warmup", type=int, default=64, help="requests before the RSS baseline is taken"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--serve-args",
        default="--dtype float32 --max-model-len 1024",
        help="extra arguments of the started `pagoda serve`",
    )
    args = parser.parse_args()
    proc = None
    base_url, pids = args.base_url, list(args.pids)
    if base_url is None:
        proc, pids = _start_serve(args.port, args.serve_args.split())
        base_url = f"http://127.0.0.1:{args.port}"
    cfg = SoakConfig(
        base_url=base_url,
        pids=pids,
        requests=args.requests,
        duration_s=args.duration,
        concurrency=args.concurrency,
        cancel_fraction=args.cancel_fraction,
        rss_tolerance=args.rss_tolerance,
        warmup_requests=args.warmup,
        seed=args.seed,
    )
    try:
        report = asyncio.run(soak(cfg))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    print_report(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
