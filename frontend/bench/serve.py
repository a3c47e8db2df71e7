"""`pagoda bench serve`: load any OpenAI-compatible server and measure it.

Sends the prompts of `datasets.py` to /v1/completions (`--backend openai`)
or /v1/chat/completions (`--backend openai-chat`) with streaming, at a
bounded concurrency and a Poisson request rate, and reports request and
token throughput and TTFT / TPOT / ITL / end-to-end latency (mean, median,
std, p99), under vLLM's field names so that either client's reports can be
read by the same tools. Several `--max-concurrency` values run one after
the other; `--plot` draws them (`plot.py`).

The client runs on aiohttp, as vLLM's does: on a small machine it shares
the cores with the server under test, and httpx's streaming took twice its
CPU per streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.frontend.bench.datasets import BenchRequest, random_requests, sharegpt_requests
from pagoda.frontend.bench.sampling import (
    add_sampling_flags,
    describe_sampling,
    sampling_settings,
)

if TYPE_CHECKING:
    import aiohttp

DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    """What one streamed request measured (times in seconds)."""

    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=sorted(DEFAULT_ENDPOINTS), default="openai")
    parser.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=None, help="default: the backend's route")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--dataset-name", choices=["random", "sharegpt"], default=None)
    parser.add_argument("--dataset-path", default=None, help="a ShareGPT-style JSON file")
    parser.add_argument("--sharegpt-output-len", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=49152, help="random token ids below")
    parser.add_argument(
        "--max-concurrency",
        type=_concurrencies,
        default=None,
        help="requests in flight at most; a comma list (1,4,16) runs each in turn",
    )
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second"
    )
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-result", action="store_true", help="write the JSON report")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--plot", default=None, metavar="PNG", help="throughput and TTFT plot")
    add_sampling_flags(parser)


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency values must be at least 1")
    return values


def run_serve(ns: argparse.Namespace) -> int:
    if ns.plot and not ns.max_concurrency:
        raise SystemExit("pagoda bench serve: --plot needs --max-concurrency values")
    if min(ns.num_prompts, ns.random_input_len, ns.random_output_len) < 1:
        raise SystemExit(
            "pagoda bench serve: --num-prompts, --random-input-len and --random-output-len "
            "must be at least 1"
        )
    if ns.request_rate <= 0:
        raise SystemExit("pagoda bench serve: --request-rate must be positive (or inf)")
    try:
        import aiohttp
    except ImportError:
        raise SystemExit("pagoda bench serve needs aiohttp: pip install 'pagoda[bench]'") from None
    try:
        reports = asyncio.run(_run_all(ns))
    except (ValueError, aiohttp.ClientError) as e:
        raise SystemExit(f"pagoda bench serve: {e}") from None
    for report in reports:
        print_report(report)
        if ns.save_result:
            path = _result_path(ns, report, several=len(reports) > 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2))
            print(f"wrote {path}")
    if ns.plot:
        from pagoda.frontend.bench.plot import plot_concurrency

        plot_concurrency({report["model_id"]: reports}, ns.plot)
        print(f"wrote {ns.plot}")
    return 0 if all(r["completed"] for r in reports) else 1


async def _run_all(ns: argparse.Namespace) -> list[dict[str, Any]]:
    import aiohttp

    base = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    timeout = aiohttp.ClientTimeout(total=ns.request_timeout)
    limit = max(ns.max_concurrency or [ns.num_prompts]) + 8
    connector = aiohttp.TCPConnector(limit=limit)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
        model = ns.model or await _first_model(client, base, headers)
        reports = []
        for i, concurrency in enumerate(ns.max_concurrency or [None]):
            # Each run draws its own prompts, so none finds another's prefix cached.
            requests = await _load_requests(ns, client, base, model, headers, ns.seed + i)
            reports.append(await _run_one(ns, client, base, model, headers, requests, concurrency))
        return reports


async def _first_model(client: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> str:
    async with client.get(base + "/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise ValueError(f"GET {base}/v1/models answered {resp.status}; give --model")
        return str((await resp.json())["data"][0]["id"])


async def _load_requests(
    ns: argparse.Namespace,
    client: aiohttp.ClientSession,
    base: str,
    model: str,
    headers: dict[str, str],
    seed: int,
) -> list[BenchRequest]:
    dataset = ns.dataset_name or ("sharegpt" if ns.dataset_path else "random")
    if dataset == "sharegpt":
        if not ns.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        requests = sharegpt_requests(ns.dataset_path, ns.num_prompts, seed, ns.sharegpt_output_len)
        for r in requests:
            if r.output_len == 0 and r.reply is not None:
                body = {"model": model, "prompt": r.reply, "add_special_tokens": False}
                r.output_len = max(1, len(await _post(client, base + "/tokenize", body, headers)))
        return requests
    requests = random_requests(
        ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.vocab_size, seed
    )
    if ns.backend == "openai-chat":
        # Chat messages are text: the server's own tokenizer turns the ids into it.
        for r in requests:
            body = {"model": model, "tokens": r.prompt}
            r.prompt = await _post(client, base + "/detokenize", body, headers)
    return requests


async def _post(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> Any:
    """/tokenize's token ids or /detokenize's text, as vLLM and Pagoda serve them."""
    async with client.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise ValueError(
                f"{url} answered {resp.status}: this dataset needs the server's "
                "/tokenize and /detokenize routes (or --sharegpt-output-len)"
            )
        answer = await resp.json()
    return answer["tokens"] if "tokens" in answer else answer["prompt"]


async def _run_one(
    ns: argparse.Namespace,
    client: aiohttp.ClientSession,
    base: str,
    model: str,
    headers: dict[str, str],
    requests: list[BenchRequest],
    concurrency: int | None,
) -> dict[str, Any]:
    from tqdm import tqdm

    url = base + (ns.endpoint or DEFAULT_ENDPOINTS[ns.backend])
    settings = sampling_settings(ns)
    seed = settings.pop("seed", None)
    semaphore = asyncio.Semaphore(concurrency or len(requests))
    rng = random.Random(ns.seed)
    bar = tqdm(total=len(requests), disable=ns.disable_tqdm, desc=f"concurrency {concurrency}")

    async def limited(i: int, request: BenchRequest) -> RequestResult:
        body = _request_body(ns, model, request, settings)
        if seed is not None:
            body["seed"] = seed + i
        async with semaphore:
            result = await send_request(client, url, body, headers, ns.backend)
        bar.update(1)
        return result

    tasks = []
    start = time.perf_counter()
    for i, request in enumerate(requests):
        tasks.append(asyncio.create_task(limited(i, request)))
        if ns.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(ns.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return build_report(ns, model, concurrency, results, duration)


def _request_body(
    ns: argparse.Namespace, model: str, request: BenchRequest, settings: dict[str, Any]
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ns.ignore_eos,
        **settings,
    }
    if ns.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = request.output_len
    else:
        body["prompt"] = request.prompt
        body["max_tokens"] = request.output_len
    return body


async def send_request(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    backend: str,
) -> RequestResult:
    """Stream one request; each chunk with text is a token arrival (TTFT, then ITLs)."""
    import aiohttp

    result = RequestResult()
    start = last = time.perf_counter()
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
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
                    result.output_tokens = chunk["usage"].get("completion_tokens") or 0
                if _chunk_text(chunk, backend):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _chunk_text(chunk: dict[str, Any], backend: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if backend == "openai-chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def build_report(
    ns: argparse.Namespace,
    model: str,
    concurrency: int | None,
    results: list[RequestResult],
    duration: float,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": ns.backend,
        "model_id": model,
        "dataset_name": ns.dataset_name or ("sharegpt" if ns.dataset_path else "random"),
        "num_prompts": len(results),
        "random_input_len": ns.random_input_len,
        "random_output_len": ns.random_output_len,
        "max_concurrency": concurrency,
        # JSON has no infinity; vLLM's reports say "inf" too.
        "request_rate": "inf" if ns.request_rate == float("inf") else ns.request_rate,
        "sampling": describe_sampling(ns),
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for name, seconds in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [x for r in ok for x in r.itls]),
        ("e2el", [r.latency for r in ok]),
    ):
        report.update(_percentiles(name, seconds))
    return report


def _percentiles(name: str, seconds: list[float]) -> dict[str, float]:
    """mean / median / std / p99 of `seconds`, in ms, under vLLM's keys."""
    ms = sorted(s * 1000 for s in seconds) or [0.0]
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
        f"p99_{name}_ms": p99,
    }


def print_report(report: dict[str, Any]) -> None:
    print(
        f"concurrency {report['max_concurrency']}, rate {report['request_rate']}: "
        f"{report['completed']}/{report['num_prompts']} completed in "
        f"{report['duration']:.2f} s (sampling: {report['sampling']})"
    )
    print(
        f"  request throughput {report['request_throughput']:.2f} req/s, "
        f"output throughput {report['output_throughput']:.1f} tok/s, "
        f"total {report['total_token_throughput']:.1f} tok/s"
    )
    for name in ("ttft", "tpot", "itl", "e2el"):
        print(
            f"  {name.upper():>4} mean {report[f'mean_{name}_ms']:8.1f} ms  "
            f"median {report[f'median_{name}_ms']:8.1f} ms  "
            f"p99 {report[f'p99_{name}_ms']:8.1f} ms"
        )
    for error in report["errors"]:
        print(f"  error: {error}")


def _result_path(ns: argparse.Namespace, report: dict[str, Any], several: bool) -> Path:
    concurrency = report["max_concurrency"]
    if ns.result_filename:
        name = ns.result_filename
        if several:
            stem, dot, ext = name.rpartition(".")
            name = f"{stem}-concurrency{concurrency}.{ext}" if dot else f"{name}-c{concurrency}"
    else:
        rate = report["request_rate"]
        model = report["model_id"].split("/")[-1]
        name = f"{ns.backend}-{rate}qps-concurrency{concurrency}-{model}-{report['date']}.json"
    return Path(ns.result_dir) / name
