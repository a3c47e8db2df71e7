"""Online serving benchmark for any OpenAI-compatible server (Pagoda, vLLM, ...).

Sends random prompts of exact token lengths (as token-id prompts, so no
tokenizer is needed and every server sees the same tokens) to
/v1/completions with streaming, at a bounded concurrency and optional
Poisson request rate, and reports request throughput, output tokens/s, and
TTFT / TPOT / ITL mean, median and p99.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 128 --input-len 128 --output-len 128 --max-concurrency 16 \\
        --temperature 0.8 --top-p 0.95 --repetition-penalty 1.1

Sampling flags carry vLLM's names (`vllm bench serve`'s); one left out is not
sent, so the server's default applies (as with vLLM's client, which no
longer sends temperature 0). The report names the settings it ran with.

The client runs on aiohttp, as vLLM's `vllm bench serve` does: on a small
machine the client shares the cores with the server under test, and
httpx's streaming took twice its CPU per streamed token (1.5 s against
0.8 s over a 64-request c=16 run, ~6% of the server's wall time on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

try:
    from scripts.sampling_flags import add_sampling_flags, describe_sampling, sampling_settings
except ImportError:  # run as a file: scripts/ is on the path, the repository root is not
    from sampling_flags import add_sampling_flags, describe_sampling, sampling_settings


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(
    client: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    api_key: str | None,
    sampling: dict[str, Any],
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **sampling,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    last = start
    result = Result(ok=False)
    try:
        async with client.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        "mean": statistics.fmean(values) * 1000,
        "median": statistics.median(values) * 1000,
        "p99": p99 * 1000,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, args.vocab_size) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    url = args.base_url.rstrip("/") + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=args.max_concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        model = args.model
        if model is None:
            async with client.get(args.base_url.rstrip("/") + "/v1/models") as r:
                models = await r.json()
            model = models["data"][0]["id"]
        semaphore = asyncio.Semaphore(args.max_concurrency)

        settings = sampling_settings(args)
        seed = settings.pop("seed", None)

        async def limited(i: int, prompt: list[int]) -> Result:
            sampling = settings if seed is None else {**settings, "seed": seed + i}
            async with semaphore:
                return await one_request(
                    client, url, model, prompt, args.output_len, args.api_key, sampling
                )

        tasks = []
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(i, prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report = {
        "model": model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "sampling": describe_sampling(args),
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "ttft_ms": summarize([r.ttft for r in ok]),
        "tpot_ms": summarize(tpots),
        "itl_ms": summarize([x for r in ok for x in r.itls]),
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here")
    add_sampling_flags(parser)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(
        f"completed {report['completed']}/{args.num_prompts} in {report['duration_s']:.1f} s "
        f"(concurrency {args.max_concurrency}; sampling: {report['sampling']})"
    )
    print(
        f"request throughput {report['request_throughput']:.2f} req/s, "
        f"output throughput {report['output_throughput']:.1f} tok/s"
    )
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        s = report[key]
        print(
            f"{key[:-3].upper():>5} mean {s['mean']:8.1f} ms  median {s['median']:8.1f} ms  "
            f"p99 {s['p99']:8.1f} ms"
        )
    if report["errors"]:
        print("errors:", report["errors"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
