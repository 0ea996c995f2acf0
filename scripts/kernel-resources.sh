#!/usr/bin/env bash
# Registers, spills and static shared memory of every kernel, from the local ptxas (pip CUDA
# wheels, see docs/cuda.md), for sm_90a: the same source NVRTC compiles (common.cuh prepended).
#
#   scripts/kernel-resources.sh [gemv gemm ...]   # default: every kernels/*.cu
set -euo pipefail
cd "$(dirname "$0")/.."
NV="${ORCHID_PIP_CUDA:-/work/cudavenv/lib/python3.11/site-packages/nvidia/cu13}"
[ -x "$NV/bin/nvcc" ] || { echo "no nvcc under $NV (pip install nvidia-cuda-nvcc, see docs/cuda.md)"; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
names=("$@"); [ ${#names[@]} -gt 0 ] || names=($(ls crates/orchid-cuda/kernels/*.cu | xargs -n1 basename | sed 's/\.cu$//'))
for n in "${names[@]}"; do
  cat crates/orchid-cuda/kernels/common.cuh "crates/orchid-cuda/kernels/$n.cu" > "$tmp/$n.cu"
  PATH="$NV/bin:$PATH" nvcc -arch=sm_90a -std=c++17 -cubin -I"$NV/include" -I"$NV/include/cccl" -Xptxas -v \
    -o "$tmp/$n.cubin" "$tmp/$n.cu" 2>&1 | awk -v f="$n" '
      /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); k = substr($0, RSTART+1, RLENGTH-2) }
      /bytes stack frame/ { sf = $0; sub(/^.*ptxas info *: */, "", sf) }
      /Used [0-9]+ registers/ { r = $0; sub(/^.*Used /, "", r); printf "%-10s %-28s %s | %s\n", f, k, r, sf }
      /error/ { print }'
done
