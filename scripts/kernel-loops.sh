#!/usr/bin/env bash
# The loops of one kernel's SASS for sm_90a (local nvcc and cuobjdump from the pip CUDA wheels,
# see docs/cuda.md): each backward branch's extent in instructions and the loop's most frequent
# opcodes. A static count, the proxy to check before a GPU run that a change to a hot loop cut
# the instructions it meant to (the innermost loops of a template with several instances are
# listed once per instance).
#
#   scripts/kernel-loops.sh deltanet gdn_decode_rows_stream [min-instructions, default 128]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 FILE KERNEL [MIN]   (FILE: a kernels/*.cu name without .cu)"; exit 2; }
file=$1 kernel=$2 min=${3:-128}
NV="${ORCHID_PIP_CUDA:-$("${ORCHID_CUDA_PYTHON:-python3}" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null || true)}"
[ -n "$NV" ] && [ -x "$NV/bin/nvcc" ] && [ -x "$NV/bin/cuobjdump" ] && [ -x "$NV/bin/nvdisasm" ] || {
  echo "no nvcc / cuobjdump / nvdisasm found (ORCHID_PIP_CUDA='${NV}'): pip install the CUDA wheels of docs/cuda.md"; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cargo run --release -q -p orchid-cuda --example kernel_sources -- "$tmp" > /dev/null
PATH="$NV/bin:$PATH" nvcc -arch=sm_90a -std=c++17 -cubin -I"$NV/include" -I"$NV/include/cccl" -o "$tmp/$file.cubin" "$tmp/$file.cu"
PATH="$NV/bin:$PATH" cuobjdump -sass -fun "$kernel" "$tmp/$file.cubin" > "$tmp/k.sass"
python3 - "$tmp/k.sass" "$kernel" "$min" <<'PY'
import collections, re, sys
path, kernel, least = sys.argv[1], sys.argv[2], int(sys.argv[3])
ins = []
for line in open(path):
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2)))
if not ins:
    sys.exit(f"{kernel}: no SASS (is the name right?)")
print(f"{kernel}: {len(ins)} instructions")
for addr, text in ins:
    m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
    if not m or int(m.group(1), 16) >= addr:
        continue
    lo = int(m.group(1), 16)
    body = [t for a, t in ins if lo <= a <= addr]
    if len(body) < least:
        continue
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    top = ", ".join(f"{o} {n}" for o, n in ops.most_common(8))
    print(f"  loop {lo:#x}..{addr:#x}: {len(body)} instructions ({top})")
PY
