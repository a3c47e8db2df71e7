"""`pagoda bench latency`: one batch from prompt to last token, step by step.

Each iteration adds `--batch-size` random prompts of `--input-len` tokens
(fresh ones each time, so that no prefix is cached) to the in-process
engine and runs its steps until every request has `--output-len` tokens,
timing each step. The report: the batch's end-to-end latency over the
iterations, the prefill (the steps until every request has its first
token) and the decode steps after it.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from pagoda.frontend.bench.datasets import random_token_prompts
from pagoda.frontend.bench.offline import make_llm, percentiles_ms, sampling_params, write_json
from pagoda.frontend.bench.sampling import describe_sampling

if TYPE_CHECKING:
    from pagoda.frontend.llm import LLM
    from pagoda.protocol.sampling_params import SamplingParams


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--output-json", default=None, help="write the report here")


def run_latency(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    if min(ns.batch_size, ns.input_len, ns.output_len, ns.num_iters) < 1:
        raise SystemExit(
            "pagoda bench latency: --batch-size, --input-len, --output-len and --num-iters "
            "must be at least 1"
        )
    llm = make_llm(ns)
    params = sampling_params(ns, ns.output_len)
    for i in range(ns.num_iters_warmup):
        run_batch(llm, _prompts(ns, llm, -1 - i), params)
    latencies: list[float] = []
    prefills: list[float] = []
    decode_steps: list[float] = []
    for i in tqdm(range(ns.num_iters), desc="iterations", disable=ns.disable_tqdm):
        steps, num_prefill_steps = run_batch(llm, _prompts(ns, llm, i), params)
        latencies.append(sum(steps))
        prefills.append(sum(steps[:num_prefill_steps]))
        decode_steps += steps[num_prefill_steps:]
    report: dict[str, Any] = {
        "batch_size": ns.batch_size,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "sampling": describe_sampling(ns, "SamplingParams defaults"),
        "avg_latency": sum(latencies) / len(latencies),
        "latencies": latencies,
        "latency_ms": percentiles_ms(latencies),
        "prefill_ms": percentiles_ms(prefills),
        "decode_step_ms": percentiles_ms(decode_steps),
        "num_decode_steps": len(decode_steps),
    }
    print(
        f"batch {ns.batch_size} x ({ns.input_len} -> {ns.output_len}), {ns.num_iters} iterations "
        f"(sampling: {report['sampling']})"
    )
    for key, label in (
        ("latency_ms", "latency"),
        ("prefill_ms", "prefill"),
        ("decode_step_ms", "decode step"),
    ):
        s = report[key]
        print(
            f"  {label:>11}: mean {s['mean']:9.1f} ms  median {s['median']:9.1f} ms  "
            f"p99 {s['p99']:9.1f} ms"
        )
    write_json(ns.output_json, report)
    return 0


def _prompts(ns: argparse.Namespace, llm: LLM, iteration: int) -> list[list[int]]:
    seed = ns.seed * 1_000_003 + iteration
    return random_token_prompts(ns.batch_size, ns.input_len, llm.ready.vocab_size, seed)


def run_batch(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[float], int]:
    """Run one batch to the end: each engine step's seconds, and how many were prefill.

    The prefill steps are those up to the one that gave the last request its
    first token.
    """
    for i, prompt in enumerate(prompts):
        processed = llm.processor.process_prompt(prompt)
        _, requests = llm.processor.make_requests(f"latency-{i}", processed, params)
        for request in requests:
            llm.client.add_request(request)
    started: set[str] = set()
    steps: list[float] = []
    num_prefill_steps = 0
    while llm.client.has_work():
        t0 = time.perf_counter()
        deltas = llm.client.get_outputs()
        steps.append(time.perf_counter() - t0)
        for delta in deltas:
            if delta.error:
                raise SystemExit(f"pagoda bench latency: request failed: {delta.error}")
            if delta.new_token_ids:
                started.add(delta.request_id)
        if num_prefill_steps == 0 and len(started) == len(prompts):
            num_prefill_steps = len(steps)
    return steps, num_prefill_steps
