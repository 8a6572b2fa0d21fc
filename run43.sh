#!/bin/bash
nvidia-smi --query-gpu=name --format=csv,noheader
C=16384:5376:1,5376:8192:1,43008:5376:1,5376:21504:1,16384:5376:4,5376:8192:4,43008:5376:4,5376:21504:4,1536:1152:1,13824:1152:1,4096:2560:1,20480:2560:1,2560:10240:1
python3 bench/kernel_timing/kernels_h200.py --cells $C --only gv0,gvr,ld0 --extra-kw 6,12 --quick --ncu off --budget 200 --out /tmp/k > /tmp/k.log 2>&1
cp /tmp/k.log /tmp/k/kernels_h200.jsonl $OUT/; grep -E "^correctness \(" /tmp/k.log | cut -c1-300; grep -vE "^check |^DIAG|^correctness" /tmp/k.log | tail -20
