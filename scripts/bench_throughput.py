"""Offline throughput: Pagoda's LLM.generate and HF transformers on identical prompts.

Pagoda alone: `pagoda bench throughput --temperature 0 --max-num-batched-tokens
4096` runs the same W1 (same prompts). This script is the comparison harness:
HF transformers in the same run, the decode-step split, the pipeline depth.

Workload W1 by default: 64 requests x 128 random prompt tokens -> 128 output
tokens, greedy, ignore_eos, on the default model. Both systems run in this
one invocation so that the printed ratio compares them on the same machine
state. Prints a table and, with --json, writes the figures.

    python scripts/bench_throughput.py                 # W1, both systems
    python scripts/bench_throughput.py --no-hf         # Pagoda only
    python scripts/bench_throughput.py --no-hf --decode-step --num-prompts 1
    python scripts/bench_throughput.py --no-hf --quantization int8

--decode-step also times the same prompts' prefill and first token alone (on
fresh prompts of the same shape, so that no prefix is cached) and reports the
rest per decode step: (elapsed - prefill) / (output_len - 1), the step time
at a batch of --num-prompts.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagoda.frontend.bench.datasets import random_token_prompts


def bench_pagoda(
    prompts: list[list[int]],
    output_len: int,
    dtype: str,
    fresh: list[list[int]] | None = None,
    model: str | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    pipeline_depth: int | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    from pagoda import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model,
        dtype=dtype,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        quantization=quantization,
    )
    if pipeline_depth is not None:  # plans in flight (default: one per stage)
        llm.client.engine.scheduler.pipeline_depth = pipeline_depth
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm up on other prompts (reversed), so that none of the measured ones
    # finds its prefix cached.
    warmup = [list(reversed(p)) for p in prompts[:2]]
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "system": "pagoda" if quantization is None else f"pagoda-{quantization}",
        "elapsed_s": elapsed,
        "output_tokens": num_out,
        "output_tok_s": num_out / elapsed,
        "load_s": load_s,
    }
    if fresh is not None and output_len > 1:
        t0 = time.perf_counter()
        llm.generate(fresh, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        result["prefill_s"] = time.perf_counter() - t0
        result["decode_step_ms"] = (elapsed - result["prefill_s"]) / (output_len - 1) * 1e3
    return result


def bench_hf(prompts: list[list[int]], output_len: int, dtype: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from pagoda.engine_core.model_config import default_model_path

    path = default_model_path()
    directory, name = path.rsplit("/", 1)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch_dtype)
    model.eval()
    input_ids = torch.tensor(prompts)
    mask = torch.ones_like(input_ids)
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - t0
    num_out = int((out.shape[1] - input_ids.shape[1]) * out.shape[0])
    return {
        "system": f"hf-transformers-{dtype}",
        "elapsed_s": elapsed,
        "output_tokens": num_out,
        "output_tok_s": num_out / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-step", action="store_true", help="also the time per decode step")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--model", default=None, help="Pagoda's model (default: the default)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument(
        "--quantization", "-q", default=None, choices=["gguf", "int8"], help="Pagoda's"
    )
    parser.add_argument(
        "--pipeline-depth",
        type=int,
        default=None,
        help="plans in flight at once (default: one per pipeline stage; 1 runs the stages in turn)",
    )
    args = parser.parse_args()

    prompts = random_token_prompts(args.num_prompts, args.input_len, 49152, args.seed)
    fresh = None
    if args.decode_step:
        fresh = random_token_prompts(args.num_prompts, args.input_len, 49152, args.seed + 1)
    results = [
        bench_pagoda(
            prompts,
            args.output_len,
            args.dtype,
            fresh,
            args.model,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            args.pipeline_depth,
            args.quantization,
        )
    ]
    if args.hf:
        results.append(bench_hf(prompts, args.output_len, args.dtype))
    print(f"W: {args.num_prompts} x ({args.input_len} -> {args.output_len}), {args.dtype}")
    for r in results:
        print(f"{r['system']:>28}: {r['output_tok_s']:8.1f} output tok/s ({r['elapsed_s']:.1f} s)")
        if "decode_step_ms" in r:
            print(
                f"{'':>28}  prefill + first token {r['prefill_s'] * 1e3:.0f} ms, "
                f"then {r['decode_step_ms']:.1f} ms per decode step"
            )
    if args.hf:
        ratio = results[0]["output_tok_s"] / results[1]["output_tok_s"]
        print(f"{'pagoda / hf':>28}: {ratio:8.2f}x")
        results.append({"ratio_pagoda_over_hf": ratio})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
