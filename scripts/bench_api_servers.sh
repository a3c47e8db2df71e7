#!/usr/bin/env bash
# Short-request throughput (32 prompt tokens -> 1 token, concurrency 64) with
# `pagoda serve --api-server-count 1` and then 2, alternated ROUNDS times in one
# run so that both see the same machine. JSON reports land in ${OUT:-docs/bench}
# as api_servers_n{1,2}_r{i}.json; a summary line per run is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench}
PORT=${PORT:-8124}
ROUNDS=${ROUNDS:-2}
PROMPTS=${PROMPTS:-400}
PY=.venv/bin/python
mkdir -p "$OUT"
run() {  # $1 = api server count, $2 = round
  $PY -m pagoda.frontend.pagoda_cli serve --port "$PORT" --api-server-count "$1" > "$OUT/serve_n$1.log" 2>&1 &
  local pid=$!
  until curl -sf -o /dev/null "http://127.0.0.1:$PORT/health"; do
    kill -0 $pid || { cat "$OUT/serve_n$1.log"; exit 1; }
    sleep 0.2
  done
  local B="$PY -m pagoda.frontend.pagoda_cli bench serve --base-url http://127.0.0.1:$PORT --random-input-len 32
    --random-output-len 1 --max-concurrency 64 --disable-tqdm"
  $B --num-prompts 32 > /dev/null  # warm-up
  $B --num-prompts "$PROMPTS" --save-result --result-dir "$OUT" \
    --result-filename "api_servers_n$1_r$2.json" \
    | grep -i "request throughput" | sed "s/^/N=$1 round $2: /"
  kill -TERM $pid; wait $pid || true
}
for r in $(seq 1 "$ROUNDS"); do
  run 1 "$r"
  run 2 "$r"
done
