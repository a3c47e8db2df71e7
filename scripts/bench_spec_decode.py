"""Speculative decoding by prompt lookup against none, in the engine core.

    python scripts/bench_spec_decode.py [--rounds 3] [--max-tokens 200]
        [--spec '{"method": "ngram", "num_speculative_tokens": 4, ...}'] [--c64]

c=1: the default model (SmolLM2-135M-Instruct) asked through its chat
template to repeat a paragraph with one change, or to rename a variable in
a piece of code, where prompt lookup helps. Greedy and temperature 0.8
(seeded). Output tok/s and ITL (time after the first token over the tokens
after it) per request, for an engine with --speculative-config and one
without, the same settings otherwise, alternated round by round so that
other work on the machine hits both alike. With --c64: 64 requests (or
--batch N) at once on random prompts (128 tokens in, 128 out, ignore_eos,
temperature 0.8), output tok/s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.model_config import resolve_model_path
from pagoda.engine_core.tokenizer_files import tokenizer_dir_for
from pagoda.frontend.chat_render import render_chat
from pagoda.frontend.tokenizer import Tokenizer
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams

DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)

PARAGRAPH = (
    "The old lighthouse stood at the end of the rocky point for more than a hundred "
    "years. Every night its keeper climbed the spiral stairs, trimmed the wick and "
    "polished the great lens until it shone. Ships passing in the dark relied on its "
    "steady beam to steer clear of the reef. When the keeper retired, the town voted "
    "to keep the light burning, and volunteers took turns climbing the stairs each "
    "evening."
)

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
"""

TASKS = [
    "Repeat the following paragraph word for word, but change 'lighthouse' to "
    "'tower':\n\n" + PARAGRAPH,
    "Rewrite this Python code with the parameter `items` renamed to `products`. "
    "Output only the code.\n\n" + CODE,
]


def run_one(
    engine: EngineCore, request_id: str, prompt: list[int], params: SamplingParams
) -> tuple[int, float, float]:
    """(output tokens, seconds to the first token, seconds after it) of one request."""
    started = time.perf_counter()
    assert engine.add_request(AddRequest(request_id, prompt, params, 0.0)) is None
    first = None
    num = 0
    while engine.has_work():
        for _, delta in engine.step():
            if delta.new_token_ids and first is None:
                first = time.perf_counter()
            num += len(delta.new_token_ids)
    done = time.perf_counter()
    assert first is not None
    return num, first - started, done - first


def c1(engines: dict[str, EngineCore], prompts: list[list[int]], args: argparse.Namespace) -> None:
    for label, engine in engines.items():  # warm-up: first-step costs, not measured
        run_one(engine, f"{label}-warm", prompts[0], SamplingParams(temperature=0, max_tokens=8))
    for temperature in (0.0, 0.8):
        num_tokens: dict[str, int] = {k: 0 for k in engines}
        tok_s: dict[str, list[float]] = {k: [] for k in engines}
        itl: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(args.rounds):
            for i, prompt in enumerate(prompts):
                params = SamplingParams(
                    temperature=temperature, max_tokens=args.max_tokens, seed=r * 100 + i
                )
                for label, engine in engines.items():  # alternated, request by request
                    n, _, after = run_one(engine, f"{label}-{r}-{i}", prompt, params)
                    num_tokens[label] += n
                    tok_s[label].append((n - 1) / after)
                    itl[label].append(after / (n - 1) * 1000)
        for label in engines:
            stats = engines[label].scheduler.stats()
            rate = ""
            if stats.spec_decode_num_draft_tokens:
                rate = (
                    f", drafts accepted (all so far) {stats.spec_decode_num_accepted_tokens}"
                    f"/{stats.spec_decode_num_draft_tokens}"
                )
            print(
                f"c=1 T={temperature} {label:>5}: output tok/s median "
                f"{statistics.median(tok_s[label]):6.1f}, ITL median "
                f"{statistics.median(itl[label]):5.1f} ms, {num_tokens[label]} tokens{rate}"
            )


def batch(engines: dict[str, EngineCore], args: argparse.Namespace, vocab: int) -> None:
    rng = random.Random(0)
    results: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        prompts = [[rng.randrange(vocab) for _ in range(128)] for _ in range(args.batch)]
        for label, engine in engines.items():
            params = SamplingParams(temperature=0.8, max_tokens=128, ignore_eos=True)
            started = time.perf_counter()
            for i, p in enumerate(prompts):
                engine.add_request(AddRequest(f"{label}-b{r}-{i}", p, params, 0.0))
            num = 0
            while engine.has_work():
                for _, delta in engine.step():
                    num += len(delta.new_token_ids)
            results[label].append(num / (time.perf_counter() - started))
    for label, values in results.items():
        stats = engines[label].scheduler.stats()
        print(
            f"c={args.batch} random {label:>5}: output tok/s median "
            f"{statistics.median(values):6.1f} "
            f"(runs {', '.join(f'{v:.0f}' for v in values)}), drafts accepted "
            f"{stats.spec_decode_num_accepted_tokens}/{stats.spec_decode_num_draft_tokens}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--c64", action="store_true", help="also random prompts at once")
    parser.add_argument("--batch", type=int, default=64, help="how many, with --c64")
    parser.add_argument("--skip-c1", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="e.g. gguf: the 4-bit path")
    args = parser.parse_args()
    common = dict(dtype=args.dtype, quantization=args.quantization)
    engines = {
        "none": EngineCore(EngineConfig(**common)),  # type: ignore[arg-type]
        "ngram": EngineCore(EngineConfig(**common, speculative_config=args.spec)),  # type: ignore[arg-type]
    }
    tokenizer = Tokenizer(tokenizer_dir_for(resolve_model_path(None)))
    prompts = [
        tokenizer.encode(
            render_chat(tokenizer, [{"role": "user", "content": task}]), add_special_tokens=False
        )
        for task in TASKS
    ]
    print(f"spec config {args.spec}; prompts of {[len(p) for p in prompts]} tokens")
    if not args.skip_c1:
        c1(engines, prompts, args)
    if args.c64:
        batch(engines, args, engines["none"].info.vocab_size)


if __name__ == "__main__":
    main()
