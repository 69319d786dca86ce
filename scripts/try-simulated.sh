#!/usr/bin/env bash
# Try memsnap on your own program without a GPU: build memsnap and the simulated CUDA driver
# the tests use (tests/fake_cuda), build FILE.c against it (or run FILE.py with python3),
# run it under `memsnap run`, and say where the snapshots are.
#
#   bash scripts/try-simulated.sh FILE.c [ARGS...]     a C program using the CUDA runtime API
#   bash scripts/try-simulated.sh FILE.py [ARGS...]    a Python program reaching libcudart through ctypes
#
# C: include <cuda_runtime.h> (or <cuda_runtime_api.h>; both stand for the simulated
# runtime's header, tests/fake_cuda/cuda_fake.h, which declares the subset of the runtime
# and driver APIs it implements; driver calls use their versioned names, cuMemAlloc_v2) and,
# for memsnap's C API, "memsnap.h" (include/). The program is linked against the simulated
# libcudart.so.13. Python: load "libcudart.so.13" with ctypes (it is on the library path) and
# `import memsnap` for steps and dumps (tests/programs/py_alloc.py is an example).
# Everything lands in the clone's memsnap-try/ (or $MEMSNAP_TRY_DIR): fake-cuda/, bin/, snapshots/.
set -euo pipefail
if [ $# -lt 1 ] || { [[ $1 != *.c ]] && [[ $1 != *.py ]]; }; then
    sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
FILE=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
[ -f "$FILE" ] || { echo "try-simulated: no such file: $FILE" >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${MEMSNAP_TRY_DIR:-$PWD/memsnap-try}
mkdir -p "$OUT/bin" "$OUT/include"
OUT=$(cd "$OUT" && pwd)

if [ -x target/release/memsnap ] && [ -f target/release/libmemsnap.so ]; then
    echo "== cargo build --release --workspace (up to date in seconds unless sources changed)"
else
    echo "== cargo build --release --workspace (a first build: 4 to 8 minutes on 2 cores)"
fi
cargo build --release --workspace
echo "== building the simulated CUDA driver and runtime into $OUT/fake-cuda"
bash scripts/build-fake-cuda.sh "$OUT/fake-cuda" >/dev/null

name=$(basename "$FILE")
if [[ $FILE == *.c ]]; then
    for h in cuda_runtime.h cuda_runtime_api.h; do
        printf '/* The simulated CUDA runtime (scripts/try-simulated.sh). */\n#include "cuda_fake.h"\n' \
            >"$OUT/include/$h"
    done
    prog=$OUT/bin/${name%.c}
    echo "== cc $name -> $prog"
    "${CC:-cc}" -std=gnu11 -g -O1 -I"$OUT/include" -I"$ROOT/tests/fake_cuda" -I"$ROOT/include" \
        -o "$prog" "$FILE" -L"$OUT/fake-cuda/lib" -lcudart -ldl -lpthread
    cmd=("$prog" "$@")
else
    cmd=(python3 "$FILE" "$@")
fi

rm -rf "$OUT/snapshots"
mkdir -p "$OUT/snapshots"
echo "== memsnap run -- ${cmd[*]}   (on the simulated driver)"
status=0
LD_LIBRARY_PATH="$OUT/fake-cuda/lib" FAKE_CUDART="$OUT/fake-cuda/lib/libcudart.so.13" \
    target/release/memsnap run --folder "$OUT/snapshots" -- "${cmd[@]}" || status=$?
echo
if compgen -G "$OUT/snapshots/*.pickle" >/dev/null; then
    newest=$(ls -t "$OUT"/snapshots/*.pickle | head -n 1)
    echo "Snapshots in $OUT/snapshots/; the newest: $newest"
    echo "Read it: $ROOT/target/release/memsnap summary $newest"
else
    echo "No snapshot in $OUT/snapshots/: the program made no CUDA allocation memsnap saw"
fi
exit "$status"
