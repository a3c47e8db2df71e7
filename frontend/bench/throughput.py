"""`pagoda bench throughput`: offline generation throughput of the in-process LLM.

All prompts go to `LLM.generate` at once, after a short warm-up on other
prompts (so that none of the measured ones finds its prefix cached); the
report is requests/s and tokens/s over the measured call. The defaults are
workload W1 of docs/benchmarks.md: 64 random prompts of 128 tokens, 128
tokens out each, ignoring EOS.
"""

from __future__ import annotations

import argparse
import time

from pagoda.frontend.bench.datasets import random_token_prompts, sharegpt_requests
from pagoda.frontend.bench.offline import make_llm, sampling_params, write_json
from pagoda.frontend.bench.sampling import describe_sampling


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="random prompt tokens")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dataset-path", default=None, help="a ShareGPT-style JSON file")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--output-json", default=None, help="write the report here")


def run_throughput(ns: argparse.Namespace) -> int:
    if ns.num_prompts < 1 or ns.output_len < 1:
        raise SystemExit("pagoda bench throughput: --num-prompts and --output-len must be >= 1")
    llm = make_llm(ns)
    seed = ns.seed
    if ns.dataset_path:
        try:
            requests = sharegpt_requests(ns.dataset_path, ns.num_prompts, seed, None)
        except ValueError as e:
            raise SystemExit(f"pagoda bench throughput: {e}") from None
        tokenizer = llm.get_tokenizer()
        prompts: list[str | list[int]] = [r.prompt for r in requests]
        output_lens = [
            max(1, len(tokenizer.encode(r.reply or "", add_special_tokens=False))) for r in requests
        ]
    else:
        vocab_size = llm.ready.vocab_size
        prompts = list(random_token_prompts(ns.num_prompts, ns.input_len, vocab_size, seed))
        output_lens = [ns.output_len] * ns.num_prompts
    params = [sampling_params(ns, n) for n in output_lens]

    warmup = random_token_prompts(2, 16, llm.ready.vocab_size, seed + 1)
    llm.generate(warmup, sampling_params(ns, 4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not ns.disable_tqdm)
    elapsed = time.perf_counter() - start

    num_in = sum(len(o.prompt_token_ids or []) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    report = {
        "num_requests": len(outputs),
        "sampling": describe_sampling(ns, "SamplingParams defaults"),
        "elapsed_time": elapsed,
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (num_in + num_out) / elapsed,
        "output_tokens_per_second": num_out / elapsed,
    }
    print(
        f"Throughput: {report['requests_per_second']:.2f} requests/s, "
        f"{report['tokens_per_second']:.2f} total tokens/s, "
        f"{report['output_tokens_per_second']:.2f} output tokens/s "
        f"({len(outputs)} requests, {num_in} prompt + {num_out} output tokens in "
        f"{elapsed:.2f} s; sampling: {report['sampling']})"
    )
    write_json(ns.output_json, report)
    return 0
