#!/usr/bin/env bash
# memsnap's cost per recorded event, end to end, on this machine (no GPU): the simulated
# CUDA runtime's cudaMallocAsync/cudaFreeAsync in a training-loop-like pattern (a window of
# 16 live allocations, free the oldest + allocate a new one per iteration, sizes from a fixed
# set of 256 in a deterministic pseudo-random order, 6 call sites in rotation), without
# memsnap and with it in each stack mode. From C (runtime compiled in, benches/programs/hook_cost.c)
# and from Python through ctypes (benches/python/hook_cost.py); the stack depths are measured
# by the programs and printed.
#
# Every preloaded run writes its exit snapshot into a folder of its own; the table reports
# what the snapshots say was recorded, dropped and left without a stack, and a configuration
# that lost anything in any run gets "VOID (...)" instead of a cost figure.
#
#   bash benches/hooks.sh    (Markdown tables; ROUNDS=3 by default, ~20 s per round on 2 cores)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. benches/support/common.sh
cargo build --release --workspace --quiet
OUT=target/bench-hooks
bench_simulated_driver "$OUT"
LIB=$PWD/target/release/libmemsnap.so
bench_clean_env
PY=$(bench_python)
RUNS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/memsnap-bench-hooks.XXXXXX")
trap 'rm -rf "$RUNS_DIR"' EXIT

# run <config> <cmd...>: config = baseline or STACKS[/all] (/all: MEMSNAP_CONTEXT=all).
# Prints "<config> <program's ns> <program's CUDA calls> <snapshot counts or none>".
run() {
    local config=$1; shift
    local out dir counts err=$RUNS_DIR/stderr
    if [ "$config" = baseline ]; then
        out=$("$@" 2>"$err") || { cat "$err" >&2; exit 1; }
        counts=none
    else
        local stacks=${config%/*} context=alloc
        [ "$config" != "$stacks" ] && context=all
        dir=$(mktemp -d "$RUNS_DIR/run.XXXXXX")
        # memsnap's own warnings (dropped events) go to $err: the table reports the counts.
        out=$(LD_PRELOAD=$LIB MEMSNAP_STACKS=$stacks MEMSNAP_CONTEXT=$context \
              MEMSNAP_AT_EXIT=1 MEMSNAP_QUIET=1 MEMSNAP_FOLDER=$dir "$@" 2>"$err") \
            || { cat "$err" >&2; exit 1; }
        counts=$("$PY" "$BENCH_COUNTS" "$dir" || true) # "missing" (or a failed read) voids the row
        rm -rf "$dir"
    fi
    set -- $out # ns calls frames
    echo "$config $1 $2 $counts"
    echo "$3 $2" >"$RUNS_DIR/about" # frames calls
}

echo "command: ROUNDS=${ROUNDS:-3} bash benches/hooks.sh"
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(bench_machine)"
echo "python: $($PY --version 2>&1)  memsnap: $(bench_commit src crates/format), release build"
echo
ROUNDS=${ROUNDS:-3}
echo "Per iteration: one cudaFreeAsync (oldest of 16 live) + one cudaMallocAsync, size from a"
echo "fixed set of 256 (512 B .. 64 MiB), 6 call sites in rotation. An event is one alloc or"
echo "one free; per event = (iteration - baseline) / 2. Default MEMSNAP_CONTEXT=alloc:"
echo "allocations carry a stack, frees reuse it. Events recorded, dropped and stackless are"
echo "read from each run's exit snapshot (recorded: per run; dropped, stackless: summed over"
echo "all runs of the row). A row that lost anything in any run is VOID: no figure is given."
echo
configs="baseline none python native all python/all all/all"
for caller in C Python; do
    if [ "$caller" = C ]; then
        cmd=("$OUT/hook_cost" 200000 26); what="runtime compiled in"; frames="native frames at cudaMallocAsync"
    else
        cmd=("$PY" benches/python/hook_cost.py 100000); what="through ctypes"; frames="Python frames at the ctypes call"
    fi
    results=$RUNS_DIR/$caller.runs
    : >"$results"
    # Rounds interleave the configurations, so a burst of load elsewhere hits all of them.
    for _ in $(seq "$ROUNDS"); do
        for c in $configs; do
            run "$c" "${cmd[@]}" >>"$results"
        done
    done
    read -r n_frames n_calls <"$RUNS_DIR/about"
    echo "**$caller** ($what): $n_frames $frames, $n_calls CUDA calls per run."
    echo
    echo "| caller | memsnap | ns per iteration (best of $ROUNDS rounds x 5 runs) | ns per event over baseline | events recorded per run | dropped | stackless |"
    echo "|---|---|---|---|---|---|---|"
    base=
    while IFS=$'\t' read -r c ns recorded dropped stackless verdict; do
        if [ "$c" = baseline ]; then
            base=$ns
            echo "| $caller | not loaded | $ns | — | — | — | — |"
            continue
        fi
        label="MEMSNAP_STACKS=${c%/*}"
        [ "$c" != "${c%/*}" ] && label="$label, MEMSNAP_CONTEXT=all (frees too)"
        if [ "$verdict" = OK ]; then
            per_event=$(awk -v t="$ns" -v b="$base" 'BEGIN { printf "%.0f", (t - b) / 2 }')
        else
            per_event=$verdict
        fi
        echo "| $caller | $label | $ns | $per_event | $recorded | $dropped | $stackless |"
    done < <("$PY" "$BENCH_COUNTS" tally <"$results")
    echo
done
