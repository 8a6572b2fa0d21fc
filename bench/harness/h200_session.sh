#!/usr/bin/env bash
# The H200 decode experiment (Gemma 3 1B geometry, optionally Gemma 4 31B
# geometry; random weights; the canonical harness bench/harness/serve_benchmark.py), run
# detached so it can outlast one 10-minute device call. After staging MAX:
#   source /root/max-env.sh; bash bench/harness/h200_session.sh start         # Gemma 3 (decode, in-graph paths), then wait
#   source /root/max-env.sh; bash bench/harness/h200_session.sh start-gemma4  # Gemma 4 (31B geometry), alone or later
#   source /root/max-env.sh; bash bench/harness/h200_session.sh wait          # wait again, collect
#   bash bench/harness/h200_session.sh collect                               # copy what is there, now
#   bash bench/harness/h200_session.sh stop                                  # end it (servers included), collect
# (never put a pkill -f pattern in the device command line itself: it matches its own shell)
# Each call waits up to WAIT_S (540 s) and copies tables and log digests to $OUT.
# GPU 0. One harness run for all Gemma 3 cells: every server is up before the
# first trial (a trial beside nine compiling servers has run at 40 % speed).
# The generated_linear kernel check runs last, on an idle card (KERNEL_BENCH=1).
# Override: E2E_CELLS, INGRAPH_CELLS, G3_FRACTION (0.5: MAX applies it to the
# capped arena), INGRAPH_SET (a or b: half of the in-graph grid each), MM_PERCENT
# (10; empty: MAX's default), G4_MM_PERCENT (empty;
# the Gemma 4 cells set their own), G4_CELLS, G4_FALLBACK_CELLS, G4_LAYERS (30),
# G4_FRACTION (0.9), G4_FALLBACK_FRACTION (0.42), SESSIONS (2), TRIALS (3 per
# session), KERNEL_BENCH (0), WAIT_S (540), REFERENCE_CELLS (torch's greedy
# texts, G:R: "13:4 13:32 1:4 1:32").
set -uo pipefail
WORK="${WORK:-/tmp/h200-session}"
DRAFT_ARGS=""  # set by run_gemma4 when a cell drafts with the assistant (MTP)
OUT="${OUT:-/tmp/out}"
HERE="$(cd "$(dirname "$0")" && pwd)"
LOCK="$WORK/gpu.lock"  # held while anything is timed: measurements never overlap
# Weight preparation on the host unless a cell's +ENV says otherwise (one
# Gemma 4 cell asks for the GPU).
export ATTNQUANT_PREPARE_DEVICE="${ATTNQUANT_PREPARE_DEVICE:-cpu}"
# The end-to-end decode cells (capture pinned on every cell).
# NVFP4 + capture first (the harness starts the first cell alone). NVFP4 capture
# off with DISPATCH=gemv (no F.cond) is the A/B for capture-off NVFP4's slowness.
E2E_CELLS="${E2E_CELLS-attnquant-nvfp4:on builtin-bf16:off attnquant-bf16:on attnquant-nvfp4:off \
attnquant-nvfp4:off+ATTNQUANT_NVFP4_DISPATCH=gemv}"
# In-graph reconstruction paths (precompute-outside serves dense W_eff:
# the same graph as attnquant-bf16:on above, so that cell is their baseline).
# Capture-on servers each back their whole arena (~13 GB at MM_PERCENT=10):
# with the two e2e ones, six in-graph cells fill the card.
# GEMM and fold at R=4 need the rank padding (attnquant.max_compat.MIN_INNER_MULTIPLE).
IG="attnquant-bf16:on+ATTNQUANT_PRECOMPUTE_OUTSIDE=0"
GEMM="$IG+ATTNQUANT_GEMM=1" GENERATED="$IG+ATTNQUANT_GEMM=0" FOLD="$IG+ATTNQUANT_PRECOMPUTE=1"
# The in-graph grid: each path at G in {1, 13, 26} x R in {4, 32} (G = 26 is
# passthrough: no residual, R does not apply), 15 cells. Nine capturing
# servers fill the card, so it takes two leases: INGRAPH_SET=a (seven cells),
# then b (the other eight).
# E2E_CELLS="attnquant-bf16:on" gives both their baseline (dense W_eff).
case "${INGRAPH_SET:-a}" in
  a) SET="$GEMM+ATTNQUANT_BLOCKS=1+ATTNQUANT_RANK=4 $GEMM+ATTNQUANT_BLOCKS=1+ATTNQUANT_RANK=32 \
$GEMM+ATTNQUANT_BLOCKS=13+ATTNQUANT_RANK=4 $GEMM+ATTNQUANT_BLOCKS=13+ATTNQUANT_RANK=32 \
$GEMM+ATTNQUANT_BLOCKS=26 $GENERATED+ATTNQUANT_BLOCKS=13+ATTNQUANT_RANK=32 \
$FOLD+ATTNQUANT_BLOCKS=13+ATTNQUANT_RANK=4" ;;
  b) SET="$GENERATED+ATTNQUANT_BLOCKS=1+ATTNQUANT_RANK=4 $GENERATED+ATTNQUANT_BLOCKS=1+ATTNQUANT_RANK=32 \
$GENERATED+ATTNQUANT_BLOCKS=13+ATTNQUANT_RANK=4 $GENERATED+ATTNQUANT_BLOCKS=26 \
$FOLD+ATTNQUANT_BLOCKS=1+ATTNQUANT_RANK=4 $FOLD+ATTNQUANT_BLOCKS=1+ATTNQUANT_RANK=32 \
$FOLD+ATTNQUANT_BLOCKS=13+ATTNQUANT_RANK=32 $FOLD+ATTNQUANT_BLOCKS=26" ;;
  *) echo "INGRAPH_SET must be a or b, not '$INGRAPH_SET'" >&2; exit 2 ;;
esac
INGRAPH_CELLS="${INGRAPH_CELLS-$SET}"

bench() {  # bench NAME MODEL MEMORY_FRACTION PORT PROMPTS CELLS...
  local name=$1 model=$2 fraction=$3 port=$4 prompts=$5; shift 5
  mkdir -p "$WORK/$name"
  # shellcheck disable=SC2086  # DRAFT_ARGS: zero or four words
  python3 "$HERE/serve_benchmark.py" --model "$model" --cells "$@" $DRAFT_ARGS \
    --sessions "${SESSIONS:-2}" --trials "${TRIALS:-3}" --num-prompts "$prompts" \
    --memory-fraction "$fraction" --port-base "$port" --gpu-lock "$LOCK" \
    --out "$WORK/$name/results.jsonl" > "$WORK/$name-table.txt" 2>&1
}

memory_env() {  # memory_env ARENA_PERCENT (empty: MAX's default arena)
  export HF_HUB_OFFLINE=1 MAX_SERVE_DISABLE_TELEMETRY=1
  # A capture-on server backs its whole memory-manager arena up front; uncapped,
  # the next one failed in vmmCreate (OOM). Capped, eight servers (five capturing) fit
  # (docs/dev/lab-log.md).
  [ -n "$1" ] && export MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT="$1"
  # What each process holds, every 20 s (the evidence if capture fails again);
  # one logger per machine, though run and run-gemma4 both come here.
  [ -e "$WORK/gpumem.pid" ] && return
  ( while sleep 20; do date +%T; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
      nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader; done ) >> "$WORK/gpumem.log" 2>&1 &
  echo $! > "$WORK/gpumem.pid"
}

run() {
  memory_env "${MM_PERCENT-10}"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > "$WORK/gpu.txt"
  python3 "$HERE/../checkpoints/make_random_gemma3.py" "$WORK/g3-model" 2>&1 | tail -1
  if [ -n "$INGRAPH_CELLS" ]; then  # torch's greedy text per in-graph path, while the servers
    # compile; it holds the timing lock, so no trial starts beside it (capped: a late one is skipped)
    ( OMP_NUM_THREADS=4 flock "$LOCK" timeout "${REFERENCE_S:-420}" python3 "$HERE/../checks/ingraph_greedy_reference.py" \
        "$WORK/g3-model" --device cuda:0 --cells ${REFERENCE_CELLS:-13:4 13:32 1:4 1:32} > "$WORK/greedy-reference.txt" 2>&1 ) &
    sleep 2  # it takes the lock before the first server is up
  fi
  # shellcheck disable=SC2086
  bench gemma3 "$WORK/g3-model" "${G3_FRACTION:-0.5}" 8100 8 $E2E_CELLS $INGRAPH_CELLS  # 0.5 of the capped arena
  if [ "${KERNEL_BENCH:-0}" = 1 ]; then  # the generated_linear check and timing, on an idle card
    flock "$LOCK" timeout "${KERNEL_BENCH_S:-480}" python3 "$HERE/../checks/generated_linear_h200.py" \
      --out "$WORK/genlin" > "$WORK/genlin.txt" 2>&1
  fi
  touch "$WORK/done"
}

# Gemma 4 at 31B geometry: MAX built-in bf16 vs NVFP4-all vs
# QUANT_IGNORE=self_attn. Neither of MAX 26.7's built-in Gemma 4s compiles for
# sm_90a there (bench/checks/sm90_model_compile.py --max-builtin), so the baseline is
# ours at bf16 passthrough (MAX's ModuleV3 Gemma 4 layers, two matmuls split)
# *without* capture: MAX's built-in for Gemma4ForConditionalGeneration, the
# 31B's architecture, does not capture. Ours capture (each cell's :on/:off says so),
# plus NVFP4's capture-off twin for the on/off greedy identity.
# Memory: MAX plans weights + a fixed 15 GiB of Gemma 4 activations (+ 0.3
# GiB signal buffers) within 0.9 of a server's arena; the arena is a
# percentage of the memory free when the server starts, and a capturing
# server backs all of it. The harness starts the first cell alone in every
# session, so the others see ~104 of 140 GiB. Needs (GiB): NVFP4-all
# 25.6 (25 % of 140 = 35, backed), bf16 45.2 (51 % of 104: 53, uses ~33),
# NVFP4-MLP 31.3 (36 % of 104: 38, backed), the twin 25.6 (30 % of 104: 31,
# uses ~13): ~120 GiB in all (measured on the H200, 2026-12-01: 35.6 + 33.1
# + 37.4 + 13.8 = 122 GiB; all 24 trials were done 22 device minutes after
# the machine started). Listed in priority: session 1's last cells are the first a short
# lease loses.
G4CAP="MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT"
# Weights are prepared on the host (ATTNQUANT_PREPARE_DEVICE=cpu above) except
# in the NVFP4-MLP cell, the first serving run of GPU preparation: if it
# breaks, the cell that breaks is not the main one.
G4_CELLS="${G4_CELLS-attnquant-nvfp4:on+$G4CAP=25 attnquant-bf16:off+$G4CAP=51 \
attnquant-nvfp4-mlp:on+$G4CAP=36+ATTNQUANT_PREPARE_DEVICE=auto attnquant-nvfp4:off+$G4CAP=30}"
# If NVFP4 with capture measured nothing: both NVFP4 variants uncaptured, on the
# GEMV dispatch (no per-projection branch, ~23 us each uncaptured).
G4_FALLBACK_CELLS="${G4_FALLBACK_CELLS-attnquant-nvfp4:off+ATTNQUANT_NVFP4_DISPATCH=gemv \
attnquant-nvfp4-mlp:off+ATTNQUANT_NVFP4_DISPATCH=gemv}"

run_gemma4() {  # alone, or after run on the same machine: shares the lock
  memory_env "${G4_MM_PERCENT-}"  # per cell above; empty here
  # 30 layers: the bytes-per-token ceiling of NVFP4-all over bf16 is 2.90x
  # there (1.94x at 6 layers: the bf16 LM head dominates; docs/dev/lab-log.md).
  python3 "$HERE/../checkpoints/make_random_gemma4.py" "$WORK/g4-model" --layers "${G4_LAYERS:-30}" 2>&1 | tail -1
  # NVFP4 preparation on the GPU vs the host, 2 layers: same bits? how fast?
  timeout 240 python3 "$HERE/../checks/prepare_device_check.py" "$WORK/g4-model" --layers 2 > "$WORK/prepare-device.txt" 2>&1
  case "$G4_CELLS" in *-mtp3*)  # a random assistant, and the target under the name MAX pairs with it
    python3 "$HERE/../checkpoints/make_random_gemma4_assistant.py" "$WORK/g4-model" "$WORK/g4-assistant" \
      --mtp-target "$WORK/g4-mtp" 2>&1 | tail -2
    DRAFT_ARGS="--draft-model $WORK/g4-assistant --mtp-target $WORK/g4-mtp" ;;
  esac
  # shellcheck disable=SC2086
  bench gemma4 "$WORK/g4-model" "${G4_FRACTION:-0.9}" 8500 8 $G4_CELLS  # 0.9 of each capped arena
  if ! grep -qs '"cell": "attnquant-nvfp4:on' "$WORK/gemma4/results.jsonl" && [ -n "$G4_FALLBACK_CELLS" ]; then
    # shellcheck disable=SC2086
    bench gemma4-uncaptured "$WORK/g4-model" "${G4_FALLBACK_FRACTION:-0.42}" 8600 8 $G4_FALLBACK_CELLS
  fi
  touch "$WORK/g4-done"
}

finished() {  # every experiment started on this machine has finished
  { [ ! -e "$WORK/g3-started" ] || [ -e "$WORK/done" ]; } &&
    { [ ! -e "$WORK/g4-started" ] || [ -e "$WORK/g4-done" ]; }
}

collect() {  # at most 8 files come back
  mkdir -p "$OUT"
  cat "$WORK"/gpu.txt "$WORK"/session.log > "$OUT/session.txt" 2>/dev/null
  cp "$WORK"/*-table.txt "$WORK"/genlin.txt "$OUT/" 2>/dev/null
  cat "$WORK"/*/results.jsonl > "$OUT/results.jsonl" 2>/dev/null
  for f in "$WORK"/*/greedy_texts.json; do echo "== $f"; cat "$f"; done > "$OUT/greedy.txt" 2>/dev/null
  { echo "== torch reference"; grep -a -o -E "G=[0-9]+ R=.*|.*(Error|Traceback).*" "$WORK/greedy-reference.txt"; } \
    >> "$OUT/greedy.txt" 2>/dev/null
  for f in "$WORK"/*/serve-*.log; do  # one digest of every server log
    # (progress bars left out: they push the preparation-device line out of the tail)
    echo "== $f"; grep -E "attnquant|NVFP4|capture|Traceback|Error|rror:|constraint" "$f" |
      grep -v -e "^INFO.*HTTP" -e "it/s\]" | tail -40
  done > "$OUT/server-logs.txt" 2>/dev/null
  cat "$WORK"/gemma4-session.log "$WORK"/prepare-device.txt >> "$OUT/session.txt" 2>/dev/null
  tail -n 400 "$WORK/gpumem.log" > "$OUT/gpumem.txt" 2>/dev/null
  finished && echo "experiment done" || echo "experiment still running"
  tail -n 30 "$WORK"/*-table.txt "$WORK"/genlin.txt 2>/dev/null
}

case "${1:-}" in
  start)
    mkdir -p "$WORK"; touch "$WORK/g3-started"
    setsid nohup bash "$0" run > "$WORK/session.log" 2>&1 < /dev/null &
    sleep 5; exec bash "$0" wait ;;
  start-gemma4)
    mkdir -p "$WORK"; touch "$WORK/g4-started"
    setsid nohup bash "$0" run-gemma4 > "$WORK/gemma4-session.log" 2>&1 < /dev/null &
    sleep 5; exec bash "$0" wait ;;
  collect) collect ;;  # now, without waiting
  stop)  # end the experiment: each harness stops its servers' process groups
    pkill -f "h200_session.sh run"; pkill -f "generated_linear_h200.py"
    pkill -TERM -f "serve_benchmark.py"; sleep 20; collect ;;
  wait)
    deadline=$(( SECONDS + ${WAIT_S:-540} ))
    while ! finished && (( SECONDS < deadline )); do sleep 10; done
    collect ;;
  run) run ;;
  run-gemma4) run_gemma4 ;;
  *) echo "usage: $0 start|start-gemma4|wait|collect|stop" >&2; exit 2 ;;
esac
