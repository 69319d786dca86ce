#!/usr/bin/env bash
# How long a snapshot request takes (memsnap_dump(), the dump signal, an out-of-memory error,
# exit, SIGTERM) while 2, 8, 32 and 64 other threads allocate at full speed (the release
# library on the simulated CUDA driver, MEMSNAP_STACKS=all), and what the snapshot recorded
# (a request figure from a run that lost events is void). From the request to the file (dump,
# signal, oom) or to the process's end (exit, term).
#
#   bash benches/requests.sh        (RUNS=5 by default; LIB=... another build; FAKE_CUDA=...
#                                          below; THREADS="64" some thread counts only;
#                                          prints a Markdown table)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. benches/support/common.sh
[ -n "${LIB:-}" ] || cargo build --release --workspace --quiet
OUT=target/bench-requests
mkdir -p "$OUT"
# FAKE_CUDA=DIR: a simulated driver and test programs built before (scripts/build-fake-cuda.sh
# DIR), for a machine that cannot build them (one without the C++ stand-in's compiler).
FAKE=${FAKE_CUDA:-$OUT/fake-cuda}
[ -n "${FAKE_CUDA:-}" ] || bash scripts/build-fake-cuda.sh "$FAKE" >/dev/null
FAKE=$(cd "$FAKE" && pwd)
LIB=${LIB:-$PWD/target/release/libmemsnap.so}
BIN=$FAKE/bin/load
RUNS=${RUNS:-5}
export LD_LIBRARY_PATH=$FAKE/lib FAKE_CUDA_CAPACITY=80G MEMSNAP_STACKS=all MEMSNAP_QUIET=1

echo "command: bash benches/requests.sh (RUNS=$RUNS)"
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(bench_machine)"
echo "commit: $(bench_commit)"
echo
echo "| threads allocating | request | ms: median | ms: max | events recorded (last run) | dropped | stackless |"
echo "|---|---|---|---|---|---|---|"
for threads in ${THREADS:-2 8 32 64}; do
    for mode in dump signal oom exit term; do
        times=() dropped=0 stackless=0 recorded=0
        for _ in $(seq "$RUNS"); do
            dir=$(mktemp -d "$OUT/run.XXXXXX")
            # A term run ends by its SIGTERM (status 143), as it would without memsnap.
            out=$(MEMSNAP_FOLDER=$dir LD_PRELOAD=$LIB "$BIN" "$threads" "$mode") || [ "$mode" = term ]
            ended=$(awk '{ printf "%.3f", $1 * 1000 }' /proc/uptime)
            if [ "$mode" = exit ] || [ "$mode" = term ]; then
                at=$(sed -n "s/^result ${mode}_at_ms=//p" <<<"$out")
                times+=("$(awk -v a="$at" -v e="$ended" 'BEGIN { printf "%.1f", e - a }')")
            else
                times+=("$(sed -n "s/^result ${mode}_ms=//p" <<<"$out")")
            fi
            # The exit snapshot (dump and oom runs write one too) holds the whole run.
            read -r rec drop stk < <(python3 "$BENCH_COUNTS" "$dir" || echo "0 0 0")
            recorded=$rec dropped=$((dropped + drop)) stackless=$((stackless + stk))
            rm -rf "$dir"
        done
        sorted=$(printf '%s\n' "${times[@]}" | sort -g)
        median=$(sed -n "$(((RUNS + 1) / 2))p" <<<"$sorted")
        max=$(tail -1 <<<"$sorted")
        if [ "$dropped" -ne 0 ] || [ "$stackless" -ne 0 ]; then
            median="VOID" max="VOID"
        fi
        echo "| $threads | $mode | $median | $max | $recorded | $dropped | $stackless |"
    done
done
