#!/usr/bin/env bash
# Two `pagoda serve` configurations side by side, alternated load by load
# (as bench_serving_alternated.sh does against vLLM): A_ARGS and B_ARGS are
# each server's extra flags. One line per run; JSON reports land in
# ${OUT:-/tmp/pagoda_ab}/{a,b}_r<round>_c<concurrency>.json.
#
#   A_ARGS="--max-num-batched-tokens 512" B_ARGS="--max-num-batched-tokens 1024" \
#       ROUNDS=3 LOADS="16:64 64:128" scripts/bench_pagoda_ab.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagoda_ab}
PY=.venv/bin/python
mkdir -p "$OUT"
read -ra a_args <<< "${A_ARGS:-}"
read -ra b_args <<< "${B_ARGS:-}"
$PY -m frontend.pagoda_cli serve --port 8402 "${a_args[@]}" > "$OUT/a.log" 2>&1 &
apid=$!
$PY -m frontend.pagoda_cli serve --port 8403 "${b_args[@]}" > "$OUT/b.log" 2>&1 &
bpid=$!
trap 'kill -TERM $apid $bpid 2>/dev/null || true; wait' EXIT
for port in 8402 8403; do
  until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    kill -0 "$apid" && kill -0 "$bpid" || { tail -20 "$OUT"/*.log; exit 1; }
    sleep 1
  done
  $PY scripts/bench_serving.py --base-url "http://127.0.0.1:$port" --num-prompts 8 \
    --max-concurrency 8 --output-len 16 --seed 100 > /dev/null
done

seed=10
echo "round load side out_tok/s ttft_med_ms ttft_p99_ms itl_med_ms"
for round in $(seq "${ROUNDS:-2}"); do
  for load in ${LOADS:-16:64 64:128}; do
    IFS=: read -r conc prompts <<< "$load"
    for side in "a 8402" "b 8403"; do
      read -r name port <<< "$side"
      seed=$((seed + 1))
      report="$OUT/${name}_r${round}_c${conc}.json"
      $PY scripts/bench_serving.py --base-url "http://127.0.0.1:$port" --num-prompts "$prompts" \
        --max-concurrency "$conc" --seed "$seed" --json "$report" > /dev/null
      $PY - "$report" "$round c$conc $name" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], round(r["output_throughput"], 1), round(r["ttft_ms"]["median"]),
      round(r["ttft_ms"]["p99"]), round(r["itl_ms"]["median"], 1))
PYEOF
    done
  done
done
