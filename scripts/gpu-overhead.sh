#!/usr/bin/env bash
# Kernel-overhead diagnostic, run on the GPU machine with dist/ built by scripts/gpu-build.sh:
# chains of 263 empty kernels / gemv_q4 matvecs (and variants with the weight
# loads or the x staging left out) in CUDA graphs, and one persistent kernel with grid barriers
# (crates/orchid-cuda/tests/gpu_kernel_overhead.rs). ~30 s on the H200. Log under the folder OUT
# (default /tmp/gpu-overhead); the table is printed last.
#
#   OUT=/some/dir scripts/gpu-overhead.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-overhead}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export ORCHID_KERNEL_CACHE=/tmp/orchid-kernels
{
  echo "== $(tr '\n' ' ' < dist/BUILD)"
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
  timeout 150 dist/tests/gpu_kernel_overhead --ignored --nocapture --test-threads 1 kernel_overhead
  echo "rc $?"
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
} 2>&1 | tee "$OUT/log"
echo
grep -E '^\|' "$OUT/log"
true
