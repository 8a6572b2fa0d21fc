#!/bin/bash
# Compile the sm90 GEMV kernels (bench/kernel_timing/nvfp4_ptx_harness.mojo) here, no GPU
# needed, into bench/ptx/<variant>.ptx, and, where ptxas is installed, also
# bench/ptx/<variant>.cubin (sm_90a) plus bench/ptx/ptxas.txt (registers,
# spills). bench/kernel_timing/kernels_h200.py loads the cubin when there is one (no JIT on
# the device, and the same SASS that was inspected here), else the PTX.
# MOJO=/path/to/mojo if the project's .venv has none (e.g. a git worktree).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
MOJO="${MOJO:-$ROOT/.venv/bin/mojo}"
MOJO="$(cd "$(dirname "$MOJO")" && pwd)/$(basename "$MOJO")"  # absolute: the build runs in a temp dir
ARCH="${ARCH:-sm_90a}"
TMP="$(mktemp -d)"
(cd "$TMP" && "$MOJO" build -I "$ROOT/kernels" --target-accelerator "$ARCH" --emit asm \
    -o h.s "$ROOT/bench/kernel_timing/nvfp4_ptx_harness.mojo" 2>&1 | grep -v Crashpad | grep -E -A8 "error" || true)
mkdir -p "$ROOT/bench/ptx"
rm -f "$ROOT/bench/ptx/"*.ptx "$ROOT/bench/ptx/"*.cubin "$ROOT/bench/ptx/ptxas.txt"
for f in "$TMP"/*.ptx; do
  name="$(basename "$f" | sed -E 's/^h_nvfp4_ptx_harness_//; s/^([a-z]+[0-9]*([a-z][0-9])?)_.*/\1/')"
  cp "$f" "$ROOT/bench/ptx/$name.ptx"
done
if command -v ptxas >/dev/null; then
  assemble() {  # assemble NAME [ptxas options]: bench/ptx/NAME.ptx -> NAME.cubin, its line in ptxas.txt
    local n="$1"; shift
    echo "$n: $(ptxas -arch="$ARCH" -v "$@" "$ROOT/bench/ptx/$n.ptx" -o "$ROOT/bench/ptx/$n.cubin" 2>&1 \
      | grep -E 'Used|spill|error' | sed 's/ptxas info *: //' | tr '\n' ' ')" >> "$ROOT/bench/ptx/ptxas.txt"
  }
  for f in "$ROOT"/bench/ptx/*.ptx; do
    assemble "$(basename "$f" .ptx)"
  done
  # gvr: gv0 assembled with at most 56 registers (no spills; Mojo cannot ask for
  # .maxnreg): 36 warps an SM instead of 32 where blocks of 4, 6 or 12 warps fit.
  cp "$ROOT/bench/ptx/gv0.ptx" "$ROOT/bench/ptx/gvr.ptx"
  assemble gvr -maxrregcount 56
  # gdx/zdx/rdx: gd0/zd0/rd0 with the previous kernel's output loaded through the
  # read-only path again (readonly_loads.sed), as before pdl.mojo's rule: the control
  # pdl_chain_h200.py runs beside them.
  for made in gdx:gd0 zdx:zd0 rdx:rd0; do
    n="${made%%:*}"; from="${made##*:}"
    sed -E -f "$ROOT/bench/kernel_timing/readonly_loads.sed" "$ROOT/bench/ptx/$from.ptx" > "$ROOT/bench/ptx/$n.ptx"
    assemble "$n"
  done
  cat "$ROOT/bench/ptx/ptxas.txt"
fi
ls "$ROOT/bench/ptx" | tr '\n' ' '; echo
rm -rf "$TMP"
