#!/usr/bin/env bash
# Builds, on this machine, everything the GPU machine runs (it has no Rust toolchain): the
# release binary and the release test executables of orchid-cuda, stripped, in dist/
# (git-ignored; copy it to the GPU machine with the repository). Also checks that every kernel
# compiles with NVRTC for sm_90a when a local NVRTC is available (pip wheels, see docs/cuda.md).
#
#   scripts/gpu-build.sh            # -> dist/orchid, dist/tests/*, dist/BUILD
set -euo pipefail
cd "$(dirname "$0")/.."
commit="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates scripts || echo +dirty)"
export ORCHID_GIT_COMMIT="$commit"
cargo build --release -p orchid
rm -rf dist && mkdir -p dist/tests
strip -o dist/orchid "${CARGO_TARGET_DIR:-target}/release/orchid"
cargo test --release -p orchid-cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil, os, subprocess
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        exe = m["executable"]
        name = m["target"]["name"] if m["target"]["kind"] != ["lib"] else "unit"
        subprocess.run(["strip", "-o", "dist/tests/" + name, exe], check=True)
        print("test executable:", name)
'
{
  echo "commit $commit"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(rustc --version)"
} > dist/BUILD
# Local NVRTC compile check of every kernel (skipped when no NVRTC is found).
# The nvidia/cu13 folder of the pip CUDA wheels (docs/cuda.md): $ORCHID_PIP_CUDA, else found in
# the Python environment of $ORCHID_CUDA_PYTHON (default python3).
NV="${ORCHID_PIP_CUDA:-$("${ORCHID_CUDA_PYTHON:-python3}" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null || true)}"
if [ -n "$NV" ] && [ -d "$NV/lib" ]; then
  LD_LIBRARY_PATH="$NV/lib:${LD_LIBRARY_PATH:-}" ORCHID_CUDA_INCLUDE="$NV/include:$NV/include/cccl" \
    dist/tests/nvrtc_compile --ignored --nocapture 2>&1 | grep -E "NVRTC|\.cu:|panicked|test result" || true
else
  echo "kernel compile check skipped: no pip CUDA wheels found (set ORCHID_PIP_CUDA to their nvidia/cu13 folder, see docs/cuda.md)"
fi
du -sh dist
