#!/usr/bin/env bash
# Instructions memsnap's hook executes per recorded event, counted exactly by callgrind on the
# simulated driver: a figure that load on the machine cannot move, for comparing two builds
# of the hot path. (Wall-clock costs are scripts/bench-hooks.sh's job.)
#
# The program is scripts/bench/hook_cost.c (runtime compiled in, 34 native frames at
# cudaMallocAsync, 6 call sites in rotation, 256 sizes): callgrind counts the instructions
# inside cudaMallocAsync and cudaFreeAsync, memsnap's wrappers and everything they call
# included, and the table divides by the calls made. The writer thread is not counted. Each
# run's exit snapshot must show every event with its stack (0 dropped, 0 stackless), else
# the row says VOID.
#
#   bash scripts/bench-hook-instructions.sh [LIB ...]   (default: this build's release library;
#                                                        needs valgrind; ~1 min per library)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
cargo build --release --workspace --quiet
OUT=target/bench-hooks
bash scripts/build-fake-cuda.sh "$OUT/fake-cuda" >/dev/null
cc -std=gnu11 -O2 -g -o "$OUT/hook_cost" scripts/bench/hook_cost.c \
    -DFAKE_CUDART_STATIC tests/fake_cuda/fake_cudart.c -ldl -lpthread
export LD_LIBRARY_PATH=$PWD/$OUT/fake-cuda/lib
unset LD_PRELOAD $(env | grep -o '^MEMSNAP_[A-Z_]*' || true)
ITERATIONS=${ITERATIONS:-3000}
LIBS=("$@")
[ ${#LIBS[@]} -eq 0 ] && LIBS=("$PWD/target/release/libmemsnap.so")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/memsnap-hook-ir.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# inclusive instructions of the functions named in $2.. in callgrind output $1, summed
inclusive() {
    local file=$1; shift
    callgrind_annotate --inclusive=yes "$file" 2>/dev/null | awk -v names="$*" '
        BEGIN { n = split(names, want, " ") }
        { for (i = 1; i <= n; i++) if ($NF ~ "\\[" && index($0, ":" want[i] " [") ) { v = $1; gsub(",", "", v); sum += v } }
        END { print sum + 0 }'
}

echo "command: bash scripts/bench-hook-instructions.sh ${*:-}"
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(nproc) cores, $(uname -m); $(valgrind --version)"
echo
echo "| library | memsnap | instructions per cudaMallocAsync | per cudaFreeAsync | per event over not loaded | dropped | stackless |"
echo "|---|---|---|---|---|---|---|"
base_malloc=; base_free=
for config in baseline none python native all; do
    for lib in "${LIBS[@]}"; do
        [ "$config" = baseline ] && [ "$lib" != "${LIBS[0]}" ] && continue
        dir=$(mktemp -d "$WORK/run.XXXXXX")
        env=()
        [ "$config" != baseline ] && env=(LD_PRELOAD="$lib" MEMSNAP_STACKS="$config" MEMSNAP_QUIET=1 MEMSNAP_FOLDER="$dir")
        out=$(env "${env[@]}" valgrind --tool=callgrind --callgrind-out-file="$dir/cg" \
              "$OUT/hook_cost" "$ITERATIONS" 26 2>/dev/null)
        calls=$(echo "$out" | awk '{print $2}')
        per_malloc=$(( $(inclusive "$dir/cg" cudaMallocAsync) * 2 / calls ))
        per_free=$(( $(inclusive "$dir/cg" cudaFreeAsync) * 2 / calls ))
        name=${lib#"$PWD"/}
        if [ "$config" = baseline ]; then
            base_malloc=$per_malloc; base_free=$per_free
            echo "| — | not loaded | $per_malloc | $per_free | — | — | — |"
            continue
        fi
        read -r recorded dropped stackless < <(python3 scripts/bench/snapshot_counts.py "$dir" || echo "missing - -")
        over=$(( (per_malloc + per_free - base_malloc - base_free) / 2 ))
        if [ "$recorded" = missing ] || [ "$dropped" != 0 ] || [ "$stackless" != 0 ] || [ "$recorded" -lt "$calls" ]; then
            over="VOID (recorded $recorded of $calls, dropped $dropped, stackless $stackless)"
        fi
        echo "| $name | MEMSNAP_STACKS=$config | $per_malloc | $per_free | $over | $dropped | $stackless |"
    done
done
