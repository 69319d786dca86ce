#!/usr/bin/env bash
# The whole test suite; no GPU needed. Builds the simulated CUDA driver and test programs
# itself (needs a C compiler and python3, both checked below).
#
#   bash scripts/test.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for tool in cargo cc python3; do
    command -v "$tool" >/dev/null || { echo "scripts/test.sh: $tool is required" >&2; exit 2; }
done
echo "== cargo fmt --check"
cargo fmt --check
echo "== cargo build (the preload tests need target/debug/libmemsnap.so and memsnap)"
cargo build --workspace --all-targets
echo "== snapshot checker self-test (the viewer's crash conditions)"
python3 tests/python/check_snapshot.py --self-test
echo "== cargo test"
cargo test --workspace --no-fail-fast
