#!/usr/bin/env bash
# Remakes the six PyTorch fixtures of tests/fixtures/torch on a GPU machine (python3 with torch):
#
#   OUT=/some/folder bash scripts/gpu/fixtures.sh
#
# Writes into $OUT/fixtures/ the six .pickle files, fixtures.json and table.md (see
# scripts/gpu/make_fixtures.py), and $OUT/fixtures-log.txt. Then, on the development machine:
# copy the .pickle files and fixtures.json into tests/fixtures/torch/, paste table.md into
# tests/fixtures/torch/README.md, and rewrite the goldens (BLESS=1 cargo test --test cli).
set -euo pipefail
# make_fixtures.py must run from the repository root by its relative path (its frames name it so).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${OUT:?set OUT to the folder that receives the fixtures}"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
unset LD_PRELOAD PYTORCH_CUDA_ALLOC_CONF
WORK=$(mktemp -d /tmp/memsnap-fixtures.XXXXXX)
mkdir -p "$OUT/fixtures"
set +e
timeout -k 10 540 "$PY" scripts/gpu/make_fixtures.py "$WORK" 2>&1 | tee "$OUT/fixtures-log.txt"
rc=${PIPESTATUS[0]}
set -e
cp "$WORK"/*.pickle "$WORK"/fixtures.json "$WORK"/table.md "$OUT/fixtures/" 2>/dev/null || true
ls -l "$OUT/fixtures"
if [ "$rc" -ne 0 ]; then
    echo "fixtures.sh: make_fixtures.py failed (exit $rc); whatever it wrote is in $OUT/fixtures" >&2
    exit "$rc"
fi
echo "fixtures.sh: done; the fixtures are in $OUT/fixtures"
