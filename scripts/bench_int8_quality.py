"""Quality of the quantized paths: perplexity and greedy top-1 agreement on real text.

    python scripts/bench_int8_quality.py [--tokens 4096] [--window 1024]

The text is PyTorch's README as torch's wheel ships it (the description in
its METADATA: English prose with some markdown), so it is there wherever
Pagoda is installed. It is tokenized with the default model's tokenizer and
cut into windows of --window tokens (each window starts fresh, with BOS);
every position after the first of a window is scored.

Each configuration of the default model (SmolLM2-135M-Instruct, from its
Q4_1 GGUF file) scores the same windows through the engine's prompt
logprobs:

- float32 and bfloat16: the dense weights (the GGUF's, dequantized);
- int8: `--quantization int8` on bfloat16 (dynamic W8A8 linears);
- gguf-q4: `--quantization gguf` on bfloat16 with the prompt fed in steps of
  6 tokens (`--max-num-batched-tokens 6`), so that every step runs on the
  file's own 4-bit weights (INT4_MAX_ROWS), as decoding does.

Perplexity is exp of the mean negative log-likelihood of the text's tokens;
top-1 agreement is the share of positions at which the configuration's most
likely next token is bfloat16's.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import time
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "gguf-q4": {"dtype": "bfloat16", "quantization": "gguf", "max_num_batched_tokens": 6},
}


def reference_text() -> str:
    text = importlib.metadata.metadata("torch").get_payload()  # type: ignore[attr-defined]
    if not text or len(text) < 10_000:
        raise SystemExit("torch's METADATA has no long description here")
    return str(text)


def score(name: str, windows: list[list[int]]) -> tuple[list[float], list[int], float]:
    """(logprob of each scored token, top token at each scored position, seconds)."""
    from pagoda import LLM, SamplingParams

    llm = LLM(None, max_model_len=4096, **CONFIGS[name])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    t0 = time.perf_counter()
    outputs = llm.generate(windows, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    logprobs: list[float] = []
    top: list[int] = []
    for window, out in zip(windows, outputs, strict=True):
        assert out.prompt_logprobs is not None
        for token, position in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            assert position is not None
            logprobs.append(position[token].logprob)
            top.append(next(t for t, lp in position.items() if lp.rank == 1))
    del llm
    return logprobs, top, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of text scored")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated")
    args = parser.parse_args()

    from pagoda import LLM

    tokenizer = LLM(None, dtype="float32", max_model_len=512).get_tokenizer()
    ids = tokenizer.encode(reference_text(), add_special_tokens=False)[: args.tokens]
    bos = 1
    step = args.window - 1
    windows = [[bos, *ids[i : i + step]] for i in range(0, len(ids), step)]
    print(f"{len(ids)} tokens of torch's README in {len(windows)} windows")
    results = {name: score(name, windows) for name in args.configs.split(",")}
    base_top = results["bfloat16"][1] if "bfloat16" in results else None
    print(f"{'config':>10} {'perplexity':>10} {'vs bf16':>8} {'top-1 = bf16':>12} {'s':>6}")
    ppls = {name: math.exp(-sum(r[0]) / len(r[0])) for name, r in results.items()}
    base_ppl = ppls.get("bfloat16")
    for name, (_, top, elapsed) in results.items():
        ppl = ppls[name]
        rel = f"{(ppl / base_ppl - 1) * 100:+.2f}%" if base_ppl else "-"
        agree = (
            f"{sum(a == b for a, b in zip(top, base_top, strict=True)) / len(top):.4f}"
            if base_top is not None
            else "-"
        )
        print(f"{name:>10} {ppl:10.3f} {rel:>8} {agree:>12} {elapsed:6.1f}")


if __name__ == "__main__":
    main()
