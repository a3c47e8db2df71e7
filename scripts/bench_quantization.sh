#!/usr/bin/env bash
# Dense bf16 against --quantization gguf, side by side: `pagoda serve` with
# the default model, alternated ${ROUNDS:-2} times, each running
# `pagoda bench serve` at concurrency 1 and 4 (128 -> 128, 16 prompts).
# JSON reports land in ${OUT:-docs/bench}/quant_{dense,gguf}_c{1,4}_r{N}.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench}
PORT=${PORT:-8124}
PY=.venv/bin/python
mkdir -p "$OUT"
pid=
trap '[ -n "$pid" ] && kill -TERM $pid 2>/dev/null; wait 2>/dev/null' EXIT
for round in $(seq 1 "${ROUNDS:-2}"); do
  for mode in dense gguf; do
    args=()
    [ "$mode" = gguf ] && args=(--quantization gguf)
    $PY -m pagoda.frontend.pagoda_cli serve --port "$PORT" "${args[@]}" > "$OUT/quant_serve.log" 2>&1 &
    pid=$!
    until curl -sf -o /dev/null "http://127.0.0.1:$PORT/health"; do
      kill -0 $pid || { cat "$OUT/quant_serve.log"; exit 1; }
      sleep 0.2
    done
    for c in 1 4; do
      echo "== round $round, $mode, concurrency $c"
      $PY -m pagoda.frontend.pagoda_cli bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 16 \
        --random-input-len 128 --random-output-len 128 --max-concurrency $c --disable-tqdm \
        --save-result --result-dir "$OUT" --result-filename "quant_${mode}_c${c}_r${round}.json" | grep -E "tok/s|TTFT|ITL" || true
    done
    kill -TERM $pid; wait $pid || true
    pid=
  done
done
