#!/usr/bin/env bash
# memsnap's cost per recorded event, end to end, on this machine (no GPU): the simulated
# CUDA runtime's cudaMallocAsync/cudaFreeAsync in a tight loop, without memsnap and with
# it in each stack mode. From C (runtime compiled in, 26 nested native frames) and from
# Python through ctypes (10 Python frames, ~30 native frames beneath them).
#
#   bash scripts/bench-hooks.sh          (prints a Markdown table; takes about a minute)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo build --release --quiet
OUT=target/bench-hooks
bash scripts/build-fake-cuda.sh "$OUT/fake-cuda" >/dev/null
cc -std=gnu11 -O2 -g -o "$OUT/hook_cost" scripts/bench/hook_cost.c \
    -DFAKE_CUDART_STATIC tests/fake_cuda/fake_cudart.c -ldl -lpthread
LIB=$PWD/target/release/libmemsnap.so
export LD_LIBRARY_PATH=$PWD/$OUT/fake-cuda/lib FAKE_CUDART=$PWD/$OUT/fake-cuda/lib/libcudart.so.13
export MEMSNAP_AT_EXIT=0 MEMSNAP_QUIET=1 MEMSNAP_FOLDER=$OUT
PY=${PYTHON:-python3}

run() { # run <config> <cmd...>; config = baseline or STACKS[/all] (/all: MEMSNAP_CONTEXT=all)
    local config=$1; shift
    if [ "$config" = baseline ]; then
        "$@"
    else
        local stacks=${config%/*} context=alloc
        [ "$config" != "$stacks" ] && context=all
        LD_PRELOAD=$LIB MEMSNAP_STACKS=$stacks MEMSNAP_CONTEXT=$context "$@"
    fi
}

echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(nproc) cores, $(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "python: $($PY --version 2>&1)"
echo
ROUNDS=${ROUNDS:-3}
echo "Default MEMSNAP_CONTEXT=alloc: allocations carry a stack, frees reuse it. An event is"
echo "one alloc or one free; per event = (pair - baseline) / 2."
echo
echo "| caller | memsnap | ns per alloc+free pair (best of $ROUNDS rounds x 5 runs) | ns per event over baseline |"
echo "|---|---|---|---|"
configs="baseline none python native all python/all all/all"
for caller in C Python; do
    if [ "$caller" = C ]; then cmd=("$OUT/hook_cost" 200000 26); else cmd=("$PY" scripts/bench/hook_cost.py 100000); fi
    declare -A best=()
    # Rounds interleave the configurations, so a burst of load elsewhere hits all of them.
    for _ in $(seq "$ROUNDS"); do
        for c in $configs; do
            t=$(run "$c" "${cmd[@]}")
            best[$c]=$(awk -v t="$t" -v b="${best[$c]:-1e18}" 'BEGIN { print (t < b) ? t : b }')
        done
    done
    echo "| $caller | not loaded | ${best[baseline]} | — |"
    for c in none python native all python/all all/all; do
        per_event=$(awk -v t="${best[$c]}" -v b="${best[baseline]}" 'BEGIN { printf "%.0f", (t - b) / 2 }')
        label="MEMSNAP_STACKS=${c%/*}"
        [ "$c" != "${c%/*}" ] && label="$label, MEMSNAP_CONTEXT=all (frees too)"
        echo "| $caller | $label | ${best[$c]} | $per_event |"
    done
    unset best
done
