"""`pagoda bench serve | throughput | latency`: the subcommands and their flags.

Flag names follow vLLM's `vllm bench` where the concept exists. Nothing here
imports torch or aiohttp; the subcommand that needs them does, when it runs.
"""

from __future__ import annotations

import argparse

from pagoda.engine_core.args import add_engine_args
from pagoda.frontend.bench.latency import add_latency_args, run_latency
from pagoda.frontend.bench.sampling import add_sampling_flags
from pagoda.frontend.bench.serve import add_serve_args, run_serve
from pagoda.frontend.bench.throughput import add_throughput_args, run_throughput


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="load a running OpenAI-compatible server")
    add_serve_args(serve)
    throughput = sub.add_parser("throughput", help="offline throughput of the in-process LLM")
    add_engine_args(throughput)
    add_throughput_args(throughput)
    add_sampling_flags(throughput)
    latency = sub.add_parser("latency", help="one batch's latency, step by step")
    add_engine_args(latency)
    add_latency_args(latency)
    add_sampling_flags(latency)


def run_bench(ns: argparse.Namespace) -> int:
    if ns.bench_command == "serve":
        return run_serve(ns)
    if ns.bench_command == "throughput":
        return run_throughput(ns)
    return run_latency(ns)
