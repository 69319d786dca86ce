#!/usr/bin/env bash
# Only the overhead bench (no validation cases): OUT=/some/folder bash benches/gpu/bench.sh
# Writes $OUT/results.json (with "overhead"), $OUT/log.txt; see validate.sh for the knobs.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
CASES="" BENCH=1 TOTAL_S=${TOTAL_S:-260} BENCH_S=${BENCH_S:-240} exec bash scripts/gpu/validate.sh
