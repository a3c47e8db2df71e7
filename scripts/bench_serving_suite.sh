#!/usr/bin/env bash
# Start `pagoda serve` with the default model, time start-up to /health 200,
# then run `pagoda bench serve` at concurrency 1, 16 and 64 (128 -> 128)
# and the short-request load (32 -> 1, concurrency 64). JSON reports land in
# ${OUT:-docs/bench}. Extra arguments go to `pagoda serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench}
PORT=${PORT:-8123}
PY=.venv/bin/python
mkdir -p "$OUT"
start=$(date +%s.%N)
$PY -m pagoda.frontend.pagoda_cli serve --port "$PORT" "$@" > "$OUT/serve.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
until curl -sf -o /dev/null "http://127.0.0.1:$PORT/health"; do
  kill -0 $pid || { cat "$OUT/serve.log"; exit 1; }
  sleep 0.1
done
echo "start to /health 200: $(echo "$(date +%s.%N) - $start" | bc) s" | tee "$OUT/startup.txt"
# Each load draws its own prompts (--seed), so none finds another's prefix
# in the prefix cache.
B="$PY -m pagoda.frontend.pagoda_cli bench serve --base-url http://127.0.0.1:$PORT --random-input-len 128
  --random-output-len 128 --disable-tqdm --save-result --result-dir $OUT"
$B --num-prompts 16 --max-concurrency 1 --seed 1 --result-filename serving_c1.json
$B --num-prompts 64 --max-concurrency 16 --seed 2 --result-filename serving_c16.json
$B --num-prompts 128 --max-concurrency 64 --seed 3 --result-filename serving_c64.json
$B --num-prompts 400 --random-input-len 32 --random-output-len 1 --max-concurrency 64 --seed 4 \
  --result-filename serving_short.json
