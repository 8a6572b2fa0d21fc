#!/bin/bash
# H200 only: the per-range sweep twice with the aligned register kernels, the read ceiling, and gv0/g4 against the guarded twins.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for s in a b; do
  python3 bench/kernel_timing/kernels_h200.py --ranges --ncu off --budget 200 --out /tmp/r$s > /tmp/r$s.log 2>&1
  cp /tmp/r$s/kernels_h200.jsonl $OUT/ranges-$s.jsonl; cp /tmp/r$s.log $OUT/ranges-$s.log
  grep -E "^correctness \(|FAILED|differs" /tmp/r$s.log | cut -c1-400; tail -22 /tmp/r$s.log
done
python3 bench/kernel_timing/read_ceiling_h200.py --shapes 31b,4b,1b,head --out $OUT/r > $OUT/r.log 2>&1; tail -22 $OUT/r.log
C31=16384:5376:1,5376:8192:1,43008:5376:1,5376:21504:1,16384:5376:4,5376:8192:4,43008:5376:4,5376:21504:4,16384:5376:16,5376:8192:16,43008:5376:16,5376:21504:16,262144:5376:1
python3 bench/kernel_timing/kernels_h200.py --cells $C31 --only gv0,gvg,g4,gwg,ld0 --quick --ncu off --budget 200 --out /tmp/k > /tmp/k.log 2>&1
cp /tmp/k.log /tmp/k/kernels_h200.jsonl $OUT/; grep -vE "^check |^DIAG|^correctness" /tmp/k.log | tail -22
