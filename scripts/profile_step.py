"""Where an engine step's time goes: every compiled CPU op timed inside the step.

Runs W1's prompts (random token ids, seed 0) through `LLM.generate` in this
process and times each call into the compiled ops (`pagoda.kernels.cpu_ops._run`,
their one entry point) during the chosen steps, linears told apart by
their output width (gate|up with SiLU fused shows as ":glu2"). Prints the
mean step time, each op's time per step and per call, and what is left
outside the ops (scheduling, input preparation, Python between calls).

    python scripts/profile_step.py --num-prompts 64 --steps 40:80   # decode, batch 64
    python scripts/profile_step.py --num-prompts 16 --steps 1:2     # one 2,048-token prompt step
    python scripts/profile_step.py --temperature 0.8 --top-p 0.95 --repetition-penalty 1.1

Requests are greedy unless sampling flags are given (vLLM's names); the
settings are printed with the figures. The sampler's whole call (penalties,
filters, the draw, logprobs) is timed as well as the compiled ops inside it.

Step 1 is the first step of the measured prompts (a warm-up request runs
before them); with --max-num-batched-tokens 4096 (the default here, as in
bench_throughput.py) 16 prompts of 128 tokens are prefilled in step 1.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter, defaultdict
from typing import Any

from pagoda.frontend.bench.sampling import (
    add_sampling_flags,
    describe_sampling,
    sampling_settings,
)

# What a mixed batch holds, request by request in turn: greedy, the defaults,
# a chat UI's settings, top-k, min-p, penalties, a seeded request.
MIX: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {},
    {"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.1},
    {"top_k": 50},
    {"min_p": 0.05},
    {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    {"temperature": 0.7, "top_p": 0.9, "seed": 1234},
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=100)
    parser.add_argument("--steps", default="40:80", help="START:STOP, the steps timed")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--quantization", "-q", default=None, choices=["gguf", "int8"])
    add_sampling_flags(parser, temperature=0.0)
    parser.add_argument(
        "--mix",
        action="store_true",
        help="request i takes the i-th of MIX's settings in turn (the sampling flags are ignored)",
    )
    args = parser.parse_args()
    start, stop = (int(s) for s in args.steps.split(":"))
    if not 1 <= start < stop:
        parser.error("--steps must be START:STOP with 1 <= START < STOP")

    import pagoda.engine_core.worker.model_runner as model_runner
    from pagoda import LLM, SamplingParams
    from pagoda.kernels import cpu_ops

    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 49152) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    llm = LLM(
        dtype="bfloat16",
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=args.quantization,
    )
    warmup = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([list(reversed(prompts[0]))], warmup, use_tqdm=False)

    spent: defaultdict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    timing = {"on": False, "steps": 0, "step_s": 0.0, "n": 0}
    run = cpu_ops._run

    def timed_run(ops: Any, name: str, *op_args: Any) -> Any:
        if not timing["on"]:
            return run(ops, name, *op_args)
        t0 = time.perf_counter()
        out = run(ops, name, *op_args)
        key = name
        if name == "linear_bf16_pairs":  # (x, packed, outs, bias, float_out, glu)
            key += f":{op_args[2]}" + (f":glu{op_args[5]}" if op_args[5] else "")
        elif name == "linear_int8":  # (x, packed, wscale, outs, bias, int32_out)
            key += f":{op_args[3]}"
        spent[key] += time.perf_counter() - t0
        calls[key] += 1
        return out

    cpu_ops._run = timed_run  # type: ignore[assignment]
    engine = llm.engine
    step = engine.step

    def timed_step() -> Any:
        timing["n"] += 1
        timing["on"] = start <= timing["n"] < stop
        t0 = time.perf_counter()
        out = step()
        if timing["on"]:
            timing["step_s"] += time.perf_counter() - t0
            timing["steps"] += 1
        timing["on"] = False
        return out

    sample = model_runner.sample
    sampler_s = [0.0]

    def timed_sample(*sample_args: Any) -> Any:
        t0 = time.perf_counter()
        out = sample(*sample_args)
        if timing["on"]:
            sampler_s[0] += time.perf_counter() - t0
        return out

    model_runner.sample = timed_sample  # type: ignore[assignment]
    engine.step = timed_step
    settings = sampling_settings(args)
    seed = settings.pop("seed", None)
    params = [
        SamplingParams(
            max_tokens=args.output_len,
            ignore_eos=True,
            **(
                MIX[i % len(MIX)]
                if args.mix
                else {**settings, "seed": None if seed is None else seed + i}
            ),  # type: ignore[arg-type]
        )
        for i in range(len(prompts))
    ]
    llm.generate(prompts, params, use_tqdm=False)
    steps = timing["steps"]
    if not steps:
        raise SystemExit(f"no step in {args.steps}: the run took {timing['n']} steps")
    step_ms = 1e3 * timing["step_s"] / steps
    print(f"sampling: {'MIX (one of each in turn)' if args.mix else describe_sampling(args)}")
    print(
        f"{steps} steps timed ({args.steps}), {args.num_prompts} prompts: {step_ms:.2f} ms a step"
    )
    print(f"  {'sampler (whole call)':36s} {1e3 * sampler_s[0] / steps:9.3f} ms/step")
    for key in sorted(spent, key=lambda k: -spent[k]):
        per_step, per_call = 1e3 * spent[key] / steps, 1e6 * spent[key] / calls[key]
        print(f"  {key:36s} {per_step:9.3f} ms/step {per_call:10.1f} us/call")
    outside = step_ms - 1e3 * sum(spent.values()) / steps
    print(f"  {'outside the compiled ops':36s} {outside:9.3f} ms/step")


if __name__ == "__main__":
    main()
