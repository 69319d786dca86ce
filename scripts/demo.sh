#!/usr/bin/env bash
# memsnap's main job, without a GPU: build memsnap, run the bundled demo (a small
# "training loop" that leaks one buffer per step) against the simulated CUDA driver that
# the tests use, with libmemsnap.so preloaded, and summarize the snapshot it wrote.
#
#   bash scripts/demo.sh            (output in ./memsnap-demo/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${MEMSNAP_DEMO_DIR:-$PWD/memsnap-demo}

echo "== building memsnap (cargo build --release)"
cargo build --release --quiet
echo "== building the simulated CUDA driver and the demo program"
bash scripts/build-fake-cuda.sh "$OUT/fake-cuda" >/dev/null
rm -rf "$OUT/snapshots"
mkdir -p "$OUT/snapshots"

echo "== running the demo with memsnap preloaded"
LD_LIBRARY_PATH="$OUT/fake-cuda/lib" \
LD_PRELOAD="$PWD/target/release/libmemsnap.so" \
MEMSNAP_FOLDER="$OUT/snapshots" \
MEMSNAP_EVERY=2 \
    "$OUT/fake-cuda/bin/demo"

newest=$(ls -t "$OUT"/snapshots/*exit*.pickle | head -n 1)
echo
echo "== snapshots written"
ls -l "$OUT/snapshots"
if target/release/memsnap summary --help >/dev/null 2>&1; then
    echo
    echo "== memsnap summary $newest"
    target/release/memsnap summary "$newest"
fi
echo
echo "Open $newest at https://pytorch.org/memory_viz (drag and drop), or run:"
echo "  python3 -m torch.cuda._memory_viz trace $newest"
