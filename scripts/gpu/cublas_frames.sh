#!/usr/bin/env bash
# Frames in libraries shipped without debug info (cuBLAS, cuBLASLt, the CUDA runtime) are named
# symbol+offset by the symbol whose stated size holds them, else library+offset (never the
# nearest symbol before them, docs/FORMAT.md#frames); never "??".
#
# Runs a few matrix products in PyTorch (cuBLAS handles and workspaces, some allocated by
# cuBLAS itself) under MEMSNAP_STACKS=all and MEMSNAP_CONTEXT=all, with both allocator
# backends, then reads every frame of every exit snapshot.
#
#   bash scripts/gpu/cublas_frames.sh [LIBMEMSNAP] [MEMSNAP]   (default: this build's release files)
# Prints one PASS/FAIL line per check; exits non-zero when one fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
LIB=$(realpath "${1:-target/release/libmemsnap.so}")
CLI=$(realpath "${2:-target/release/memsnap}")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/memsnap-cublas.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
status=0
for backend in native cudaMallocAsync; do
    dir="$WORK/$backend"
    mkdir -p "$dir"
    PYTORCH_CUDA_ALLOC_CONF="backend:$backend" LD_PRELOAD="$LIB" MEMSNAP_STACKS=all \
        MEMSNAP_CONTEXT=all MEMSNAP_FOLDER="$dir" MEMSNAP_QUIET=1 python3 - <<'EOF'
import torch
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    a = torch.randn(2048, 2048, device="cuda", dtype=dtype)
    b = torch.nn.functional.linear(a, a, a[0])
    c = a @ b
torch.cuda.synchronize()
EOF
    python3 - "$dir" "$backend" <<'EOF' || status=1
import glob, pickle, sys
from collections import Counter
folder, backend = sys.argv[1], sys.argv[2]
files = glob.glob(f"{folder}/*exit*.pickle")
if len(files) != 1:
    print(f"FAIL [{backend}] expected one exit snapshot, found {files}")
    sys.exit(1)
snap = pickle.load(open(files[0], "rb"))
frames = []
for trace in snap["device_traces"]:
    for e in trace:
        frames += e.get("frames", [])
for seg in snap["segments"]:
    for blk in seg["blocks"]:
        frames += blk.get("frames", [])
unknown = [f for f in frames if f["name"] in ("??", "") or f["filename"] in ("??", "")]
by_lib = Counter()
examples = {}
for f in frames:
    name = f["filename"].rsplit("/", 1)[-1]
    for lib in ("libcublasLt", "libcublas.", "libcudart", "libcuda.", "libtorch_cuda", "libc10_cuda"):
        if name.startswith(lib):
            by_lib[lib] += 1
            if "+0x" in f["name"]:
                examples.setdefault(lib, f"{f['name']} ({name})")
print(f"[{backend}] {len(frames)} frames; by library: {dict(by_lib)}")
for lib, ex in sorted(examples.items()):
    print(f"  e.g. {ex}")
ok = True
def check(what, cond, detail=""):
    global ok
    print(("PASS" if cond else "FAIL") + f" [{backend}] {what}" + (f": {detail}" if detail else ""))
    ok &= bool(cond)
check("frames were recorded", len(frames) > 0)
check("no frame is named ??", not unknown, f"{len(unknown)} unnamed, e.g. {unknown[:3]}")
check("frames without debug info are symbol+offset or library+offset",
      any("+0x" in f["name"] for f in frames), f"{sum('+0x' in f['name'] for f in frames)} such frames")
sys.exit(0 if ok else 1)
EOF
    "$CLI" summary "$(ls "$dir"/*exit*.pickle)" | sed -n '1,40p' | grep -E "\+0x|live by|allocation site" | head -12 || true
done
exit "$status"
