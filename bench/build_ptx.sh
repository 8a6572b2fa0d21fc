#!/bin/bash
# Compile the sm90 kernels to PTX here (no GPU needed) into bench/ptx/<variant>.ptx.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MOJO="${MOJO:-$ROOT/.venv/bin/mojo}"
TMP="$(mktemp -d)"
(cd "$TMP" && "$MOJO" build -I "$ROOT/kernels" --target-accelerator sm_90 --emit asm \
    -o h.s "$ROOT/bench/nvfp4_ptx_harness.mojo" 2>&1 | grep -v Crashpad || true)
mkdir -p "$ROOT/bench/ptx"
rm -f "$ROOT/bench/ptx/"*.ptx
for f in "$TMP"/*.ptx; do
  name="$(basename "$f" | sed -E 's/^h_nvfp4_ptx_harness_//; s/^(gv[0-9]+|g[0-9]+|a[0-9]+|dq)_.*/\1/')"
  cp "$f" "$ROOT/bench/ptx/$name.ptx"
done
ls "$ROOT/bench/ptx"
rm -rf "$TMP"
