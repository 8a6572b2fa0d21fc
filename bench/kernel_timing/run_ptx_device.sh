#!/bin/bash
# One device call: kernel-level bench of every PTX variant, then ncu on a few.
# Usage (on the GPU machine, repo root): bash bench/kernel_timing/run_ptx_device.sh "$OUT" [ncu specs...]
OUT="${1:-out}"; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 330 python3 bench/kernel_timing/nvfp4_ptx_bench.py --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v '^{' "$OUT/bench.log" | grep -v "^BEST" | tail -n 45
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
for spec in "$@"; do
  v="${spec%%:*}"
  timeout 120 ncu --clock-control none -k "regex:harness_${v}_" -s 1 -c 1 $SECTIONS \
      python3 bench/kernel_timing/nvfp4_ptx_bench.py --profile "$spec" > "$OUT/ncu_${v}.txt" 2>&1
  echo "== ncu $spec (rc=$?)"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Warp Per|No Eligible|Warp Cycles Per Issued|Block Limit Reg|stalled|L1/TEX Hit|L2 Hit|Eligible Warps" "$OUT/ncu_${v}.txt" | sed 's/  */ /g' | head -30
done
