#!/usr/bin/env bash
# Registers, spills and static shared memory of every kernel, from the local ptxas (pip CUDA
# wheels, see docs/cuda.md), for sm_90a: the same text NVRTC compiles (common.cuh, the ABI generated
# from the Rust definitions, the headers; written by the kernel_sources example).
#
#   scripts/kernel-resources.sh [gemv gemm ...]   # default: every kernels/*.cu
set -euo pipefail
cd "$(dirname "$0")/.."
# The nvidia/cu13 folder of the pip CUDA wheels (docs/cuda.md): $ORCHID_PIP_CUDA, else found in
# the Python environment of $ORCHID_CUDA_PYTHON (default python3).
NV="${ORCHID_PIP_CUDA:-$("${ORCHID_CUDA_PYTHON:-python3}" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null || true)}"
[ -n "$NV" ] && [ -x "$NV/bin/nvcc" ] || { echo "no nvcc found (ORCHID_PIP_CUDA='${NV}'): pip install the CUDA wheels of docs/cuda.md and set ORCHID_PIP_CUDA to their nvidia/cu13 folder or ORCHID_CUDA_PYTHON to that environment's python"; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cargo run --release -q -p orchid-cuda --example kernel_sources -- "$tmp" > /dev/null
names=("$@"); [ ${#names[@]} -gt 0 ] || names=($(ls crates/orchid-cuda/kernels/*.cu | xargs -n1 basename | sed 's/\.cu$//'))
for n in "${names[@]}"; do
  PATH="$NV/bin:$PATH" nvcc -arch=sm_90a -std=c++17 -cubin -I"$NV/include" -I"$NV/include/cccl" -Xptxas -v \
    -o "$tmp/$n.cubin" "$tmp/$n.cu" 2>&1 | awk -v f="$n" '
      /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); k = substr($0, RSTART+1, RLENGTH-2) }
      /bytes stack frame/ { sf = $0; sub(/^.*ptxas info *: */, "", sf) }
      /Used [0-9]+ registers/ { r = $0; sub(/^.*Used /, "", r); printf "%-10s %-28s %s | %s\n", f, k, r, sf }
      /error/ { print }'
done
