#!/usr/bin/env bash
# memsnap's main job, without a GPU: build memsnap, run the bundled demo (a small
# "training loop" that leaks one buffer per step) against the simulated CUDA driver that
# the tests use, with libmemsnap.so preloaded, and summarize the snapshot it wrote.
#
#   bash scripts/demo.sh            (output in ./memsnap-demo/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${MEMSNAP_DEMO_DIR:-$PWD/memsnap-demo}

if [ -x target/release/memsnap ] && [ -f target/release/libmemsnap.so ]; then
    echo "== building memsnap (cargo build --release --workspace: seconds when up to date)"
else
    echo "== building memsnap (cargo build --release --workspace: a first build takes 4 to" \
        "8 minutes on 2 cores; cargo's progress follows)"
fi
cargo build --release --workspace
echo "== building the simulated CUDA driver and the demo program"
bash scripts/build-fake-cuda.sh "$OUT/fake-cuda" >/dev/null
rm -rf "$OUT/snapshots"
mkdir -p "$OUT/snapshots"

echo "== memsnap run -- demo   (libmemsnap.so preloaded; a snapshot every 2 steps and at exit)"
# The demo program also prints the lines the tests check it by (`result ...`, and the
# simulated driver's own `truth ...` bookkeeping): left out here. stderr goes through too,
# so that memsnap's list of files stays after the program's lines.
LD_LIBRARY_PATH="$OUT/fake-cuda/lib" \
    target/release/memsnap run --folder "$OUT/snapshots" --every 2 -- "$OUT/fake-cuda/bin/demo" \
    2>&1 | { grep -Ev '^(result|truth) ' || true; }

first=$(ls -tr "$OUT"/snapshots/*-step[0-9]*-*.pickle | head -n 1)
newest=$(ls -t "$OUT"/snapshots/*-exit-*.pickle | head -n 1)
echo
echo "== memsnap summary $newest"
target/release/memsnap summary "$newest"
echo
echo "== memsnap diff (what grew between the step-2 snapshot and exit: the leak)"
target/release/memsnap diff "$first" "$newest"
echo
echo "== memsnap explain (the answers: what leaks across the run's step snapshots, who holds the memory)"
target/release/memsnap explain "$OUT/snapshots"
target/release/memsnap view "$newest" -o "$OUT/demo.html" >/dev/null
echo
echo "Offline viewer: $OUT/demo.html"
echo "PyTorch's viewer: drag $newest onto https://pytorch.org/memory_viz"
