#!/usr/bin/env bash
# The H200 decode experiment (Gemma 3 1B geometry and Gemma 4 31B geometry,
# random weights, the canonical harness bench/serve_benchmark.py), run
# detached so it can outlast one 10-minute device call. After staging MAX:
#   source /root/max-env.sh; bash bench/h200_session.sh start   # launch, then wait
#   source /root/max-env.sh; bash bench/h200_session.sh wait    # wait again, collect
# Each call waits up to WAIT_S (540 s) and copies tables and log digests to $OUT.
# With two GPUs the two models run side by side (Gemma 3 on GPU 0, Gemma 4 on
# GPU 1: separate cards, separate servers); with one, one after the other.
# Override: G3_CELLS, G4_CELLS, G4_LAYERS (30), SESSIONS (2), TRIALS (3 per session).
set -uo pipefail
WORK="${WORK:-/tmp/h200-session}"
OUT="${OUT:-/tmp/out}"
HERE="$(cd "$(dirname "$0")" && pwd)"
G3_CELLS="${G3_CELLS:-builtin-bf16:off attnquant-bf16:off attnquant-bf16:on attnquant-nvfp4:off attnquant-nvfp4:on}"
G4_CELLS="${G4_CELLS:-builtin-bf16:off attnquant-nvfp4:off attnquant-nvfp4-mlp:off}"

bench() {  # bench NAME GPU MODEL MEMORY_FRACTION PORT CELLS...
  local name=$1 gpu=$2 model=$3 fraction=$4 port=$5; shift 5
  mkdir -p "$WORK/$name"
  CUDA_VISIBLE_DEVICES=$gpu python3 "$HERE/serve_benchmark.py" --model "$model" --cells "$@" \
    --sessions "${SESSIONS:-2}" --trials "${TRIALS:-3}" --memory-fraction "$fraction" \
    --port-base "$port" --out "$WORK/$name/results.jsonl" > "$WORK/$name-table.txt" 2>&1
}

run() {
  export HF_HUB_OFFLINE=1 MAX_SERVE_DISABLE_TELEMETRY=1
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > "$WORK/gpu.txt"
  local gpus second
  gpus=$(nvidia-smi -L | wc -l); second=$(( gpus > 1 ? 1 : 0 ))
  python3 "$HERE/make_random_gemma3.py" "$WORK/g3-model" --device cuda:0 2>&1 | tail -1 &
  python3 "$HERE/make_random_gemma4.py" "$WORK/g4-model" --layers "${G4_LAYERS:-30}" --device "cuda:$second" 2>&1 | tail -1 &
  wait
  # shellcheck disable=SC2086
  if (( gpus > 1 )); then
    bench gemma3 "${G3_GPU:-0}" "$WORK/g3-model" "${G3_FRACTION:-0.12}" "${G3_PORT:-8100}" $G3_CELLS &
    bench gemma4 "${G4_GPU:-1}" "$WORK/g4-model" "${G4_FRACTION:-0.3}" "${G4_PORT:-8200}" $G4_CELLS &
    wait
  else
    bench gemma3 0 "$WORK/g3-model" 0.12 8100 $G3_CELLS
    bench gemma4 0 "$WORK/g4-model" 0.3 8200 $G4_CELLS
  fi
  touch "$WORK/done"
}

collect() {
  mkdir -p "$OUT"
  cp "$WORK"/gpu.txt "$WORK"/session.log "$WORK"/*-table.txt "$OUT/" 2>/dev/null
  cat "$WORK"/*/results.jsonl > "$OUT/results.jsonl" 2>/dev/null
  for f in "$WORK"/*/serve-*.log; do  # one digest of every server log (only 8 files come back)
    echo "== $f"; grep -E "attnquant|NVFP4|capture|Traceback|Error|rror:" "$f" | grep -v "^INFO.*HTTP" | tail -25
  done > "$OUT/server-logs.txt" 2>/dev/null
  [ -e "$WORK/done" ] && echo "experiment done" || echo "experiment still running"
  tail -n 40 "$WORK"/*-table.txt 2>/dev/null
}

case "${1:-}" in
  start)
    mkdir -p "$WORK"
    setsid nohup bash "$0" run > "$WORK/session.log" 2>&1 < /dev/null &
    sleep 5; exec bash "$0" wait ;;
  wait)
    deadline=$(( SECONDS + ${WAIT_S:-540} ))
    while [ ! -e "$WORK/done" ] && (( SECONDS < deadline )); do sleep 10; done
    collect ;;
  run) run ;;
  *) echo "usage: $0 start|wait" >&2; exit 2 ;;
esac
