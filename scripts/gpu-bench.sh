#!/usr/bin/env bash
# Runs on the GPU machine: generates the full-size Qwen3.6-35B-A3B-shaped MLX 4-bit checkpoint
# in /dev/shm (unless present), checks CUDA against the CPU teacher-forced over 64 positions,
# and runs `orchid bench` (the protocol of docs/status.md). Extra arguments go to `orchid bench`.
#
#   scripts/gpu-bench.sh [--lengths 256,4096] [--runs 3] [--long-runs 1]
#   ORCHID_CHECK_CPU=0 skips the CPU comparison; ORCHID_PDL=0 captures the decode graph without
#   programmatic dependent launch (A/B).
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export ORCHID_KERNEL_CACHE="${ORCHID_KERNEL_CACHE:-/tmp/orchid-kernels}"
LOG="${ORCHID_LOG_DIR:-/tmp/orchid-gpu-bench}"
MODEL="${ORCHID_BENCH_MODEL:-/dev/shm/q36}"
mkdir -p "$LOG"
if [ ! -f "$MODEL/config.json" ]; then
  start=$(date +%s)
  dist/orchid synth --preset qwen3.6-35b-a3b --format mlx4 --out "$MODEL" 2>&1 | tail -3
  echo "synth: $(( $(date +%s) - start ))s, $(du -sh "$MODEL" | cut -f1)"
fi
dist/orchid bench --model "$MODEL" --check-cpu "${ORCHID_CHECK_CPU:-64}" --out "$LOG/bench.json" "$@" 2>&1 | tee "$LOG/bench.txt"
