"""The arithmetic floors of the CPU targets: what no bfloat16 engine can beat here.

Measures this machine's ceiling, then works out from the model's shapes the
best that any engine computing the model in bfloat16 (greedy parity with
the float32 reference rules out lower precision) could reach on the
workloads of the performance targets, and sets the targets beside them:

- peak: `vdpbf16ps` on 512-bit registers, 12 independent sums, one copy of
  a small compiled loop per core, all at once (needs a C compiler and
  AVX512-BF16); beside it the pairs kernel's best warm rate (the model's
  widest-input shape, 64 rows), to show how close Pagoda's linears come.
- read bandwidth: summing a 512 MiB float32 tensor on every thread.
- floors: a prompt's first token (c=1 TTFT) as the least arithmetic it
  takes (prompt_flop) at peak; short requests (32 -> 1) as prompts a second
  at peak; the 128 -> 128 load at high concurrency (c=64, and offline W1)
  as output tokens a second with the arithmetic at peak plus decoding's
  key/value reads at the measured bandwidth. Everything else an engine does
  (norms, rotary, sampling, scheduling, HTTP, the client on the same cores)
  only adds time, so each floor is generous.

    python scripts/bench_floor.py
    python scripts/bench_floor.py --ttft-ms 110 --short-req-s 46.5 --c64-tok-s 445 --json f.json

The peer figures default to ../shared/FACTS.md's vLLM CPU tuned numbers;
pass the ones measured in the same window to set the targets against those.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

# 12 independent sums so that the loop is bound by the multiply units, not by
# the instruction's latency; the inputs change every pass so nothing folds.
_PEAK_C = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(void) {
  __m512 s0 = _mm512_set1_ps(0), s1 = _mm512_set1_ps(1), s2 = _mm512_set1_ps(2),
         s3 = _mm512_set1_ps(3), s4 = _mm512_set1_ps(4), s5 = _mm512_set1_ps(5),
         s6 = _mm512_set1_ps(6), s7 = _mm512_set1_ps(7), s8 = _mm512_set1_ps(8),
         s9 = _mm512_set1_ps(9), s10 = _mm512_set1_ps(10), s11 = _mm512_set1_ps(11);
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a;
  const long n = 100000000;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < n; ++i) {
    s0 = _mm512_dpbf16_ps(s0, a, b); s1 = _mm512_dpbf16_ps(s1, a, b);
    s2 = _mm512_dpbf16_ps(s2, a, b); s3 = _mm512_dpbf16_ps(s3, a, b);
    s4 = _mm512_dpbf16_ps(s4, a, b); s5 = _mm512_dpbf16_ps(s5, a, b);
    s6 = _mm512_dpbf16_ps(s6, a, b); s7 = _mm512_dpbf16_ps(s7, a, b);
    s8 = _mm512_dpbf16_ps(s8, a, b); s9 = _mm512_dpbf16_ps(s9, a, b);
    s10 = _mm512_dpbf16_ps(s10, a, b); s11 = _mm512_dpbf16_ps(s11, a, b);
    __asm__ volatile("" : "+v"(a));
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
  __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)),
                           _mm512_add_ps(_mm512_add_ps(s4, s5), _mm512_add_ps(s6, s7)));
  t = _mm512_add_ps(t, _mm512_add_ps(_mm512_add_ps(s8, s9), _mm512_add_ps(s10, s11)));
  /* 12 instructions x 16 lanes x 2 products x (multiply + add) a pass */
  printf("%f %f\n", n * 12.0 * 64 / s / 1e9, _mm512_reduce_add_ps(t));
  return 0;
}
"""


def peak_gflops(cores: int, rounds: int = 3) -> float | None:
    """The summed rate of one copy of the loop per core, best of `rounds`."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "peak.c"), Path(tmp, "peak")
        src.write_text(_PEAK_C)
        subprocess.run([cc, "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        best = 0.0
        for _ in range(rounds):
            procs = [
                subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
                for _ in range(cores)
            ]
            rates = [float(p.communicate()[0].split()[0]) for p in procs]
            best = max(best, sum(rates))
    return best


def pairs_kernel_gflops(rounds: int = 5) -> float | None:
    """The pairs kernel's best warm rate: 64 rows through a down projection."""
    import torch

    from pagoda.kernels import cpu_ops

    if cpu_ops.load_cpu_ops() is None or not cpu_ops.has_bf16_pairs():
        return None
    rows, ins, outs = 64, 1536, 1152
    packed = cpu_ops.pack_bf16_pairs(torch.randn(outs, ins).bfloat16())
    x = torch.randn(rows, ins).bfloat16()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(50):
            cpu_ops.linear_bf16_pairs(x, packed, outs, None)
        best = min(best, (time.perf_counter() - t0) / 50)
    return 2 * rows * ins * outs / best / 1e9


def read_gbps(rounds: int = 5) -> float:
    import torch

    data = torch.ones(128 * 1024 * 1024)  # 512 MiB of float32
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.numel() * 4 / best / 1e9


def model_shapes() -> dict[str, float]:
    """The default model's work in FLOP (2 per multiply-add) and bytes: per
    token and layer, its q|k|v projection and the rest (o, gate, up, down);
    per token, the head; per query-key pair and layer, attention's scores
    and weighted values over all heads; per cached position, the key/value
    bytes over all layers."""
    from pagoda.engine_core.model_config import default_model_path, load_model_config

    c = load_model_config(default_model_path())
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "layers": float(c.num_layers),
        "qkv_flop": 2.0 * c.hidden_size * (q + 2 * kv),
        "rest_flop": 2.0 * (q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size),
        "pair_flop": 4.0 * q,
        "head_flop": 2.0 * c.hidden_size * c.vocab_size,
        "kv_bytes": 2.0 * kv * 2 * c.num_layers,  # keys and values, bfloat16
    }


def prompt_flop(shapes: dict[str, float], length: int) -> float:
    """The least arithmetic for a prompt's first token: every layer's q|k|v
    for all its tokens, the rest of the last layer for the last token only
    (the others feed no logits), causal attention, the head for one row."""
    n = shapes["layers"]
    rows = n * length * shapes["qkv_flop"] + ((n - 1) * length + 1) * shapes["rest_flop"]
    pairs = length * (length + 1) / 2
    return rows + n * pairs * shapes["pair_flop"] + shapes["head_flop"]


def floors(peak: float, bandwidth: float, shapes: dict[str, float]) -> dict[str, float]:
    per_token = shapes["layers"] * (shapes["qkv_flop"] + shapes["rest_flop"]) + shapes["head_flop"]
    # 128 -> 128: the prompt, then 127 decoded tokens, the t-th reading the
    # 128 + t cached positions' keys and values (their arithmetic is left out).
    request_flop = prompt_flop(shapes, 128) + 127 * per_token
    request_bytes = sum(128 + t for t in range(1, 128)) * shapes["kv_bytes"]
    request_s = request_flop / (peak * 1e9) + request_bytes / (bandwidth * 1e9)
    return {
        "ttft_128_ms": prompt_flop(shapes, 128) / (peak * 1e9) * 1e3,
        "short_32_req_s": peak * 1e9 / prompt_flop(shapes, 32),
        "load_128_128_tok_s": 128 / request_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--ttft-ms", type=float, default=81.0, help="peer's c=1 TTFT median")
    parser.add_argument("--short-req-s", type=float, default=64.7, help="peer's 32 -> 1 req/s")
    parser.add_argument("--c64-tok-s", type=float, default=456.0, help="peer's c=64 output tok/s")
    parser.add_argument("--w1-tok-s", type=float, default=715.0, help="peer's offline W1 tok/s")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.cores)
    peak = peak_gflops(args.cores)
    kernel = pairs_kernel_gflops()
    bandwidth = read_gbps()
    if peak is None:
        raise SystemExit("needs a C compiler and AVX512-BF16 (the floor of this machine kind)")
    shapes = model_shapes()
    best = floors(peak, bandwidth, shapes)
    rows: list[tuple[str, float, float, str]] = [
        ("c=1 TTFT, 128-token prompt (ms)", best["ttft_128_ms"], 0.5 * args.ttft_ms, "<="),
        ("short 32 -> 1 (req/s)", best["short_32_req_s"], 1.5 * args.short_req_s, ">="),
        ("c=64 128 -> 128 (output tok/s)", best["load_128_128_tok_s"], 1.5 * args.c64_tok_s, ">="),
        ("W1 offline (output tok/s)", best["load_128_128_tok_s"], 1.3 * args.w1_tok_s, ">="),
    ]
    print(f"bf16 multiply peak, {args.cores} cores: {peak:.0f} GFLOP/s", end="")
    if kernel is not None:
        print(f"; pairs kernel warm, 64 rows: {kernel:.0f} GFLOP/s ({kernel / peak:.0%})", end="")
    print(f"; read bandwidth {bandwidth:.1f} GB/s")
    # What the target asks of the machine: above 1, more than its peak.
    print(f"{'workload':34} {'floor':>9} {'target':>9}  share of peak the target needs")
    for name, floor, target, sense in rows:
        need = target / floor if sense == ">=" else floor / target
        verdict = "beyond the machine" if need > 1 else ""
        print(f"{name:34} {floor:9.1f} {target:9.1f}  {need:.2f} {verdict}")
    result: dict[str, Any] = {
        "peak_gflops": peak,
        "pairs_kernel_gflops": kernel,
        "read_gbps": bandwidth,
        "shapes": shapes,
        "floors": best,
        "targets": {
            name: {"floor": f, "target": t, "share_of_peak": t / f if s == ">=" else f / t}
            for name, f, t, s in rows
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
