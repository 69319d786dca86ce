#!/usr/bin/env bash
# memsnap's main job, without a GPU: build memsnap, run the bundled demo (a small
# "training loop" that leaks one buffer per step) against the simulated CUDA driver that
# the tests use, with libmemsnap.so preloaded, and summarize the snapshot it wrote.
#
#   bash scripts/demo.sh            (output in ./memsnap-demo/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${MEMSNAP_DEMO_DIR:-$PWD/memsnap-demo}

echo "== building memsnap (cargo build --release --workspace)"
cargo build --release --workspace --quiet
echo "== building the simulated CUDA driver and the demo program"
bash scripts/build-fake-cuda.sh "$OUT/fake-cuda" >/dev/null
rm -rf "$OUT/snapshots"
mkdir -p "$OUT/snapshots"

echo "== memsnap run -- demo   (libmemsnap.so preloaded; a snapshot every 2 steps and at exit)"
LD_LIBRARY_PATH="$OUT/fake-cuda/lib" \
    target/release/memsnap run --folder "$OUT/snapshots" --every 2 -- "$OUT/fake-cuda/bin/demo"

first=$(ls -tr "$OUT"/snapshots/*-step[0-9]*-*.pickle | head -n 1)
newest=$(ls -t "$OUT"/snapshots/*-exit-*.pickle | head -n 1)
echo
echo "== memsnap summary $newest"
target/release/memsnap summary "$newest"
echo
echo "== memsnap diff (what grew between the step-2 snapshot and exit: the leak)"
target/release/memsnap diff "$first" "$newest"
target/release/memsnap view "$newest" -o "$OUT/demo.html" >/dev/null
echo
echo "Offline viewer: $OUT/demo.html"
echo "PyTorch's viewer: drag $newest onto https://pytorch.org/memory_viz"
