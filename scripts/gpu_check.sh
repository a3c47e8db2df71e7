#!/usr/bin/env bash
# The GPU check, one command on one CUDA GPU, under 8 minutes:
#   1. every Triton kernel test at full shapes and the full parameter grid;
#   2. each kernel timed against its torch path and the memory-bandwidth floor;
#   3. end-to-end greedy parity with HF transformers through the CUDA runner
#      (float32 token for token; bfloat16 against float32, as on the CPU);
#   4. W1 offline throughput of the default model (FACTS.md);
#   5. with 2 or more GPUs, the tensor-parallel tests through worker processes;
# then a short table. Logs and JSON land in $OUT_DIR (default gpu_check_out/).
#
#   scripts/gpu_check.sh            # PY=/path/to/python to pick the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT_DIR=${OUT_DIR:-gpu_check_out}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "gpu_check: no CUDA device visible to $PY" >&2
    exit 2
}

status() { if [ "$1" -eq 0 ]; then echo pass; elif [ "$1" -eq 124 ]; then echo timeout; else echo "FAIL($1)"; fi; }

echo "== 1. kernel tests, full shapes"
PAGODA_TRITON_FULL=1 timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/triton \
    2>&1 | tee "$OUT_DIR/kernel_tests.txt"
kernel_tests=$(status "${PIPESTATUS[0]}")

echo "== 2. kernel timings"
timeout 90 "$PY" scripts/bench_triton.py --json "$OUT_DIR/kernels.json" \
    2>&1 | tee "$OUT_DIR/kernels.txt"
kernel_bench=$(status "${PIPESTATUS[0]}")

echo "== 3. greedy parity with HF through the CUDA runner"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/engine_core/test_parity.py \
    tests/engine_core/test_bf16_path.py 2>&1 | tee "$OUT_DIR/parity.txt"
parity=$(status "${PIPESTATUS[0]}")

echo "== 4. W1 throughput (64 x 128 -> 128, bf16, greedy)"
timeout 90 "$PY" scripts/bench_throughput.py --no-hf --json "$OUT_DIR/throughput_w1.json" \
    2>&1 | tee "$OUT_DIR/throughput.txt"
throughput=$(status "${PIPESTATUS[0]}")

echo "== 5. tensor parallelism 2 through worker processes (only with 2 or more GPUs)"
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ]; then
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/engine_core/test_mp_executor.py \
        -k "llama-2-shm or qwen3-2-shm" 2>&1 | tee "$OUT_DIR/tensor_parallel.txt"
    tensor_parallel=$(status "${PIPESTATUS[0]}")
else
    tensor_parallel="skipped ($gpus GPU)"
fi

echo
echo "== summary"
"$PY" - "$OUT_DIR" "$kernel_tests" "$kernel_bench" "$parity" "$throughput" "$tensor_parallel" <<'PYEOF'
import json, os, sys
out, tests, bench, parity, thr, tp = sys.argv[1:]
print(f"{'check':<34} result")
print(f"{'kernel tests (full shapes)':<34} {tests}")
print(f"{'greedy parity vs HF (fp32, bf16)':<34} {parity}")
print(f"{'tensor parallelism 2 (mp)':<34} {tp}")
w1 = os.path.join(out, "throughput_w1.json")
if os.path.exists(w1):
    r = json.load(open(w1))["results"][0]
    print(f"{'W1 throughput':<34} {r['output_tok_s']:.0f} output tok/s ({r['elapsed_s']:.1f} s)")
else:
    print(f"{'W1 throughput':<34} {thr}")
k = os.path.join(out, "kernels.json")
if os.path.exists(k):
    data = json.load(open(k))
    print(f"\n{data['device']}, copy bandwidth {data['bandwidth_Bps'] / 1e9:.0f} GB/s")
    print(f"{'kernel':<20} {'triton ms':>10} {'torch ms':>9} {'floor ms':>9} {'of floor':>8}")
    for r in data["rows"]:
        print(f"{r['kernel']:<20} {r['triton_ms']:10.3f} {r['torch_ms']:9.3f}"
              f" {r['floor_ms']:9.3f} {r['floor_ms'] / r['triton_ms']:8.0%}")
else:
    print(f"{'kernel timings':<34} {bench}")
PYEOF
[ "$kernel_tests" = pass ] && [ "$kernel_bench" = pass ] && [ "$parity" = pass ] && [ "$throughput" = pass ]
