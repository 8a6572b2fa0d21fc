#!/usr/bin/env bash
# One device call on the H200 (after MAX is staged): random Gemma 3 1B geometry,
# the canonical serve harness over every cell; a table and logs under $OUT.
#   source /root/max-env.sh; bash bench/gemma3_h200.sh [TRIALS]
set -uo pipefail
TRIALS="${1:-3}"
OUT="${OUT:-/tmp/out}"
LOGS=/tmp/bench-logs
MODEL=/tmp/gemma3-1b-random
mkdir -p "$LOGS" "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
python3 bench/make_random_gemma3.py "$MODEL" 2>&1 | tail -2
python3 bench/serve_benchmark.py --model "$MODEL" --trials "$TRIALS" --out "$LOGS/results.jsonl" \
  --memory-fraction 0.12 --cells ${CELLS:-builtin-bf16:off attnquant-bf16:off attnquant-bf16:on attnquant-nvfp4:on} 2>&1 | tee "$OUT/table.txt"
cp "$LOGS/results.jsonl" "$LOGS/greedy_texts.json" "$OUT/" 2>/dev/null
# Only 8 files come back: one digest of every server log.
for f in "$LOGS"/serve-*.log; do
  echo "== $f"; grep -E "attnquant load|NVFP4 \[|device_graph_capture|took|rror" "$f" | tail -12
done > "$OUT/server-logs.txt"
tail -c 200000 "$(ls -t "$LOGS"/serve-*.log | head -1)" > "$OUT/last-server.log"
