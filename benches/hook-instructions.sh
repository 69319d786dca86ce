#!/usr/bin/env bash
# Instructions memsnap executes per recorded event, counted exactly by callgrind on the
# simulated driver: figures that load on the machine cannot move, for comparing two builds
# of the hot path. (Wall-clock costs are benches/hooks.sh's job.) Three routes, each in
# every stack mode:
#
#  1. C caller, cudaMallocAsync / cudaFreeAsync: benches/programs/hook_cost.c (runtime compiled
#     in, 34 native frames at cudaMallocAsync, 6 call sites in rotation, 256 sizes).
#     Callgrind counts the instructions inside cudaMallocAsync and cudaFreeAsync, memsnap's
#     wrappers and everything they call included, divided by the calls made; "over not
#     loaded" subtracts the same program without memsnap.
#  2. Python caller, the same calls through ctypes: benches/python/hook_cost.py (12 Python
#     frames at the call, under the interpreter's and libffi's native frames).
#  2b. C caller with a training step's stack shape: benches/programs/step_shape.c (54 native
#     frames at cudaMallocAsync; consecutive allocations differ in their inner 12-22 frames,
#     one of 450 paths each time, as a real step's do: the walk unwinds about 20 frames and
#     reuses the outer 35 of the previous walk). Route "step".
#  3. PyTorch's caching allocator, the trace tracker (src/pytorch/mod.rs): the stand-in of
#     tests/fake_torch driven from C (benches/programs/tracker_cost.c, 34 native frames at the
#     allocation) and from Python (benches/python/tracker_cost.py, 12 Python frames). Each
#     trace entry is one call of memsnap's tracker; the table gives the instructions memsnap
#     adds per entry, by entry: BlockAlloc (standin_malloc), FreeRequested (standin_free;
#     the block stays pending on a side stream) and FreeCompleted (standin_process_events),
#     each phase collected alone (--toggle-collect): the phase's instructions with memsnap
#     minus without it (no tracker attached), divided by the entries. (The tracker's own
#     inclusive count would miss its tail calls: callgrind charges a jump's target to the
#     caller.) The first round's segments (a few cudaMalloc calls) are in the BlockAlloc
#     phase, spread over its entries.
#
#  4. Route "cache": the C caller of route 1 with its caches made cold before each
#     allocation-free pair: the program writes EVICT bytes (4 MiB: twice the simulated last
#     level) outside the calls, standing for the work a real step does between two events,
#     which pushes the hook's lines out of the nearer caches (docs/HOT-PATH.md, "The
#     recording floor"). Callgrind simulates a fixed cache (I1 and D1 32 KiB and 48 KiB,
#     LL 2 MiB; not the host's, so that the figure is the same on any machine) and counts,
#     inside cudaMallocAsync and cudaFreeAsync, the lines that missed the first level and
#     the last level: per event over not loaded, the cache lines memsnap's hook reads and
#     writes that the program's own work had pushed out. On a real machine each read among
#     them is a wait; here they are counted. Between two runs of one library they move by
#     up to a line an event (the writer thread shares the simulated cache, and when it wakes
#     follows the clock): compare two builds within one run, and repeat. Only the cold
#     runs are collected (cold_loop).
#  4a. Route "runtime-cache": route 4 with the program linked to the simulated shared runtime
#     instead of a static one, as PyTorch's cudaMallocAsync mode calls it: memsnap's runtime
#     hooks (cudaMallocAsync / cudaFreeAsync) record, and the driver calls the runtime makes
#     underneath, through the driver entry points it looked up (cuGetProcAddress), reach
#     memsnap's driver hooks, which pass them through. What memsnap's own instructions run
#     and miss, per pair, counted instruction by instruction (benches/python/
#     lines_by_instruction.py; the hooks' inclusive counts are not usable there: see the route).
#  4b. Route "tracker-cache": the same count for PyTorch's caching allocator, the tracker of
#     route 3 driven from C, after two warm-up rounds, with EVICT bytes written before each
#     block allocation (outside it): cache lines missed per BlockAlloc entry (inside
#     standin_malloc), with memsnap minus without it.
#  4c. Route "python-cache": the same count for a Python caller (benches/python/cold_hook.py
#     --one: 10 Python frames deep, through ctypes; a C loop writes EVICT bytes before each
#     cudaMallocAsync + cudaFreeAsync pair, after 40,000 warm pairs, and only that loop is
#     collected, by callgrind's client requests; needs valgrind's headers): the lines the Python walk and the rest of the hook miss, per
#     event over not loaded. PAIRS_CACHE pairs (200).
#
# The writer thread is not in the hook figures; its own work is given apart: instructions of
# `Writer::apply` per event applied (routes 1 and 2). Each run's exit snapshot must show
# every event with its stack (0 dropped, 0 stackless), else the row says VOID.
#
#   bash benches/hook-instructions.sh [LIB ...]   (default: this build's release library;
#                                                        needs valgrind; ~3 min per library)
#   ROUTES="c step python tracker cache runtime-cache tracker-cache python-cache" (default the first four), ITERATIONS (C, 3000), ITERATIONS_CACHE (cache: 40, x 5 runs),
#   ROUNDS_CACHE (tracker-cache: rounds of 64 blocks after 2 warm-up rounds, 5),
#   EVICT (cache: bytes written before each pair, 4194304), PY_ITERATIONS (1000),
#   C_DEPTH (route c's nesting, 26: 34 frames at cudaMallocAsync; 70: 78 frames, a stack cut at
#   the 64-frame limit, as 29-32% of a real step's are),
#   ROUNDS (tracker rounds of 64 blocks, C 100, Python 30), PYTHON (python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. benches/support/common.sh
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
[ $# -eq 0 ] && cargo build --release --lib --quiet
OUT=target/bench-hooks
bench_simulated_driver "$OUT"
cc -std=gnu11 -O2 -g -o "$OUT/hook_cost_runtime" benches/programs/hook_cost.c \
    -L"$OUT/fake-cuda/lib" -lcudart -ldl -lpthread
cc -std=gnu11 -O2 -g -o "$OUT/step_shape" benches/programs/step_shape.c \
    -DFAKE_CUDART_STATIC tests/fake_cuda/fake_cudart.c -ldl -lpthread
cc -std=gnu11 -O2 -g -o "$OUT/tracker_cost" benches/programs/tracker_cost.c \
    -L"$OUT/fake-cuda/lib" -lcudart -ldl -lpthread
export STANDIN_LIB=$PWD/$OUT/fake-cuda/torch/lib/libc10_cuda.so
bench_clean_env
PY=$(bench_python)
ITERATIONS=${ITERATIONS:-3000}
C_DEPTH=${C_DEPTH:-26}
PY_ITERATIONS=${PY_ITERATIONS:-1000}
ROUTES=${ROUTES:-c step python tracker}
LIBS=("$@")
[ ${#LIBS[@]} -eq 0 ] && LIBS=("$PWD/target/release/libmemsnap.so")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/memsnap-hook-ir.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# the instructions and the events $3 (comma-separated, or none) of the function named $2,
# inclusive, in callgrind output $1, space-separated (the row with the most instructions,
# where two objects have one: memsnap's hook and the driver function it wraps)
inclusive_events() {
    callgrind_annotate --inclusive=yes --threshold=100 --show="Ir${3:+,$3}" "$1" 2>/dev/null | awk -v name="$2" '
        $NF ~ "\\[" && index($0, ":" name " [") {
            v = $1; gsub(",", "", v)
            if (v + 0 >= max) {
                max = v + 0; row = ""
                for (i = 2; i <= NF && $i !~ /:/; i++) {
                    if ($i ~ /^\(/ || $i ~ /%\)$/) continue # a percentage
                    x = $i; gsub(",", "", x); if (x == ".") x = 0; row = row " " x
                }
            }
        }
        END { print max + 0 row }'
}

# inclusive instructions of the function named $2 in callgrind output $1
inclusive() { inclusive_events "$1" "$2" "" | awk '{ print $1 }'; }

# all instructions collected in callgrind output $1
total() { callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/ && !done { v = $1; gsub(",", "", v); if (v == ".") v = 0; print v; done = 1 }'; }

# "<recorded> <dropped> <stackless>" of a run's folder, or "missing - -"
counts() { "$PY" "$BENCH_COUNTS" "$1" 2>/dev/null || echo "missing - -"; }

# run_cg DIR CONFIG LIB TOGGLE CMD...: callgrind over CMD, memsnap preloaded unless CONFIG is
# baseline (CONFIG: STACKS or STACKS/all for MEMSNAP_CONTEXT=all); prints CMD's stdout.
run_cg() {
    local dir=$1 config=$2 lib=$3 toggle=$4; shift 4
    local env=() opts=()
    if [ "$config" != baseline ]; then
        local stacks=${config%/*} context=alloc
        [ "$config" != "$stacks" ] && context=all
        env=(LD_PRELOAD="$lib" MEMSNAP_STACKS="$stacks" MEMSNAP_CONTEXT="$context" MEMSNAP_QUIET=1 MEMSNAP_FOLDER="$dir")
    fi
    [ -n "$toggle" ] && opts=(--toggle-collect="$toggle")
    [ -n "${CG_CACHE:-}" ] && opts+=(--cache-sim=yes --I1=32768,8,64 --D1=49152,12,64 --LL=2097152,16,64)
    [ -n "${CG_INSTR:-}" ] && opts+=(--dump-instr=yes)
    env "${env[@]}" valgrind --tool=callgrind "${opts[@]}" --callgrind-out-file="$dir/cg" "$@" 2>/dev/null
}

# cold_pairs_table PAIRS F_MALLOC F_FREE TOGGLE CMD...: the rows of a cold-cache route over
# allocation-free pairs, one per library and stack mode after the run without memsnap:
# instructions and D1 / LL misses per pair inside F_MALLOC and F_FREE (inclusive), and per
# event over not loaded. TOGGLE: the function callgrind collects alone ("" for a command that
# switches collection itself); CMD may start with valgrind options.
cold_pairs_table() {
    local pairs=$1 f_malloc=$2 f_free=$3 toggle=$4; shift 4
    echo "| library | memsnap | instructions per pair | D1 misses per pair (read + write) | LL misses per pair (read + write) | D1 misses per event over not loaded | LL misses per event over not loaded | dropped | stackless |"
    echo "|---|---|---|---|---|---|---|---|---|"
    local base_d1= base_ll= config lib dir ir d1 ll name recorded dropped stackless over_d1 over_ll void
    local ir_m d1r_m d1w_m llr_m llw_m ir_f d1r_f d1w_f llr_f llw_f
    for config in baseline none python native all; do
        for lib in "${LIBS[@]}"; do
            [ "$config" = baseline ] && [ "$lib" != "${LIBS[0]}" ] && continue
            dir=$(mktemp -d "$WORK/run.XXXXXX")
            CG_CACHE=1 run_cg "$dir" "$config" "$lib" "$toggle" "$@" >/dev/null
            read -r ir_m d1r_m d1w_m llr_m llw_m < <(inclusive_events "$dir/cg" "$f_malloc" D1mr,D1mw,DLmr,DLmw)
            read -r ir_f d1r_f d1w_f llr_f llw_f < <(inclusive_events "$dir/cg" "$f_free" D1mr,D1mw,DLmr,DLmw)
            ir=$(( (ir_m + ir_f) / pairs ))
            d1=$(awk -v a="$d1r_m" -v b="$d1w_m" -v c="$d1r_f" -v d="$d1w_f" -v n="$pairs" 'BEGIN { printf "%.2f", (a + b + c + d) / n }')
            ll=$(awk -v a="$llr_m" -v b="$llw_m" -v c="$llr_f" -v d="$llw_f" -v n="$pairs" 'BEGIN { printf "%.2f", (a + b + c + d) / n }')
            name=${lib#"$PWD"/}
            if [ "$config" = baseline ]; then
                base_d1=$d1; base_ll=$ll
                echo "| — | not loaded | $ir | $d1 | $ll | — | — | — | — |"
                continue
            fi
            read -r recorded dropped stackless < <(counts "$dir")
            over_d1=$(awk -v a="$d1" -v b="$base_d1" 'BEGIN { printf "%.2f", (a - b) / 2 }')
            over_ll=$(awk -v a="$ll" -v b="$base_ll" 'BEGIN { printf "%.2f", (a - b) / 2 }')
            void=$(bench_void "$recorded" "$dropped" "$stackless")
            [ -z "$void" ] || { over_d1=$void; over_ll=; }
            echo "| $name | MEMSNAP_STACKS=$config | $ir | $d1 | $ll | $over_d1 | $over_ll | $dropped | $stackless |"
        done
    done
}

echo "command: bash benches/hook-instructions.sh ${*:-}"
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  machine: $(bench_machine); $(valgrind --version); python: $($PY --version 2>&1)"
echo "memsnap: $(bench_commit src)"

for route in $ROUTES; do
    case $route in
    c | step | python)
        # In the shared runtime cudaMallocAsync is a jump to malloc_async (callgrind sees no
        # call of its own): count that.
        if [ "$route" = c ]; then
            cmd=("$OUT/hook_cost" "$ITERATIONS" "$C_DEPTH"); what="C caller (benches/programs/hook_cost.c)"
            f_malloc=cudaMallocAsync; f_free=cudaFreeAsync
        elif [ "$route" = step ]; then
            cmd=("$OUT/step_shape" "$ITERATIONS" 30); what="C caller, a training step's stack shape (benches/programs/step_shape.c)"
            f_malloc=cudaMallocAsync; f_free=cudaFreeAsync
        else
            cmd=("$PY" benches/python/hook_cost.py "$PY_ITERATIONS"); what="Python caller through ctypes (benches/python/hook_cost.py)"
            f_malloc=malloc_async; f_free=cuMemFreeAsync # cudaFreeAsync: a jump, inlined free_async
        fi
        echo
        echo "**$what**"
        echo
        echo "| library | memsnap | instructions per cudaMallocAsync | per cudaFreeAsync | per event over not loaded | writer: per event applied | dropped | stackless |"
        echo "|---|---|---|---|---|---|---|---|"
        base_malloc=; base_free=; about=
        for config in baseline none python native all; do
            for lib in "${LIBS[@]}"; do
                [ "$config" = baseline ] && [ "$lib" != "${LIBS[0]}" ] && continue
                dir=$(mktemp -d "$WORK/run.XXXXXX")
                out=$(run_cg "$dir" "$config" "$lib" "" "${cmd[@]}")
                calls=$(echo "$out" | awk '{print $2}')
                about="$(echo "$out" | awk '{print $3}') frames, $calls calls per run"
                per_malloc=$(( $(inclusive "$dir/cg" $f_malloc) * 2 / calls ))
                per_free=$(( $(inclusive "$dir/cg" $f_free) * 2 / calls ))
                name=${lib#"$PWD"/}
                if [ "$config" = baseline ]; then
                    base_malloc=$per_malloc; base_free=$per_free
                    echo "| — | not loaded | $per_malloc | $per_free | — | — | — | — |"
                    continue
                fi
                writer=$(( $(inclusive "$dir/cg" memsnap::writer::Writer::apply) / calls ))
                read -r recorded dropped stackless < <(counts "$dir")
                over=$(( (per_malloc + per_free - base_malloc - base_free) / 2 ))
                void=$(bench_void "$recorded" "$dropped" "$stackless" "$calls")
                [ -z "$void" ] || over=$void
                echo "| $name | MEMSNAP_STACKS=$config | $per_malloc | $per_free | $over | $writer | $dropped | $stackless |"
            done
        done
        echo
        echo "($about.)"
        ;;
    tracker)
        # From Python (TRACKER_PY=1): the run without memsnap collects nothing under
        # --toggle-collect (not understood yet), so that route has no baseline and no figure.
        for caller in C ${TRACKER_PY:+Python}; do
            if [ "$caller" = C ]; then
                cmd=("$OUT/tracker_cost" "${ROUNDS:-100}" 26); what="native frames at the allocation"
            else
                cmd=("$PY" benches/python/tracker_cost.py "${ROUNDS:-30}"); what="Python frames at the allocation"
            fi
            echo
            program=benches/programs/tracker_cost.c; [ "$caller" = Python ] && program=benches/python/tracker_cost.py
            echo "**PyTorch tracker, $caller caller** ($program): instructions memsnap adds per trace entry (with it minus without it)"
            echo
            echo "| library | memsnap | BlockAlloc | FreeRequested | FreeCompleted | dropped | stackless |"
            echo "|---|---|---|---|---|---|---|"
            about=
            declare -A base=()
            for phase in standin_malloc standin_free standin_process_events; do
                dir=$(mktemp -d "$WORK/run.XXXXXX")
                run_cg "$dir" baseline "" "$phase" "${cmd[@]}" >/dev/null
                base[$phase]=$(total "$dir/cg")
            done
            for config in none python native all all/all; do
                for lib in "${LIBS[@]}"; do
                    row=(); void=
                    for phase in standin_malloc standin_free standin_process_events; do
                        dir=$(mktemp -d "$WORK/run.XXXXXX")
                        out=$(run_cg "$dir" "$config" "$lib" "$phase" "${cmd[@]}")
                        read -r n_malloc n_free n_complete frames <<<"$out"
                        about="$frames $what; $n_malloc, $n_free and $n_complete entries per phase"
                        case $phase in
                        standin_malloc) n=$n_malloc ;; standin_free) n=$n_free ;; *) n=$n_complete ;;
                        esac
                        row+=("$(( ($(total "$dir/cg") - ${base[$phase]}) / n ))")
                        read -r recorded dropped stackless < <(counts "$dir")
                        lost=$(bench_void "$recorded" "$dropped" "$stackless")
                        [ -z "$lost" ] || void=$lost
                    done
                    label="MEMSNAP_STACKS=${config%/*}"
                    [ "$config" != "${config%/*}" ] && label="$label, MEMSNAP_CONTEXT=all"
                    if [ -n "$void" ]; then
                        echo "| ${lib#"$PWD"/} | $label | $void | | | $dropped | $stackless |"
                    else
                        echo "| ${lib#"$PWD"/} | $label | ${row[0]} | ${row[1]} | ${row[2]} | $dropped | $stackless |"
                    fi
                done
            done
            echo
            echo "($about.)"
        done
        ;;
    tracker-cache)
        evict=${EVICT:-4194304}
        rounds=${ROUNDS_CACHE:-5}
        cmd=("$OUT/tracker_cost" "$rounds" 26 "$STANDIN_LIB" "$evict")
        echo
        echo "**PyTorch tracker with cold caches** (benches/programs/tracker_cost.c, $evict bytes written before each block allocation; simulated I1 32 KiB, D1 48 KiB, LL 2 MiB): per BlockAlloc entry (standin_malloc), with memsnap minus without it"
        echo
        echo "| library | memsnap | instructions over not loaded | D1 misses over not loaded (read + write) | LL misses over not loaded (read + write) | dropped | stackless |"
        echo "|---|---|---|---|---|---|---|"
        # Without memsnap no tracker is attached and the program counts no entries: the
        # baseline's totals are divided by the entries of the run beside it.
        dir=$(mktemp -d "$WORK/run.XXXXXX")
        CG_CACHE=1 run_cg "$dir" baseline "" cold_rounds "${cmd[@]}" >/dev/null
        read -r ir_b d1r_b d1w_b llr_b llw_b < <(inclusive_events "$dir/cg" standin_malloc D1mr,D1mw,DLmr,DLmw)
        for config in none python native all; do
            for lib in "${LIBS[@]}"; do
                dir=$(mktemp -d "$WORK/run.XXXXXX")
                # (the whole output first: a `read` from a process substitution would return
                # before callgrind has written its file)
                out=$(CG_CACHE=1 run_cg "$dir" "$config" "$lib" cold_rounds "${cmd[@]}")
                read -r n_malloc _ _ frames <<<"$out"
                read -r ir d1r d1w llr llw < <(inclusive_events "$dir/cg" standin_malloc D1mr,D1mw,DLmr,DLmw)
                over() { awk -v a="$1" -v b="$2" -v c="$3" -v d="$4" -v n="$n_malloc" 'BEGIN { printf "%.2f", (a + b - c - d) / n }'; }
                over_ir=$(( (ir - ir_b) / n_malloc ))
                over_d1=$(over "$d1r" "$d1w" "$d1r_b" "$d1w_b"); over_ll=$(over "$llr" "$llw" "$llr_b" "$llw_b")
                read -r recorded dropped stackless < <(counts "$dir")
                void=$(bench_void "$recorded" "$dropped" "$stackless")
                [ -z "$void" ] || { over_d1=$void; over_ll=; }
                echo "| ${lib#"$PWD"/} | MEMSNAP_STACKS=$config | $over_ir | $over_d1 | $over_ll | $dropped | $stackless |"
            done
        done
        echo
        echo "($frames native frames at the allocation; $rounds rounds of 64 blocks after 2 not collected: $n_malloc entries; not loaded: $(( ir_b / n_malloc )) instructions, $(awk -v a="$llr_b" -v b="$llw_b" -v n="$n_malloc" 'BEGIN { printf "%.2f", (a + b) / n }') LL misses an entry.)"
        ;;
    cache)
        evict=${EVICT:-4194304}
        echo
        echo "**C caller with cold caches** (benches/programs/hook_cost.c, $evict bytes written before each pair; simulated I1 32 KiB, D1 48 KiB, LL 2 MiB): cache lines missed per call, inside cudaMallocAsync / cudaFreeAsync"
        echo
        cold_pairs_table $(( ${ITERATIONS_CACHE:-40} * 5 )) cudaMallocAsync cudaFreeAsync cold_loop \
            "$OUT/hook_cost" "${ITERATIONS_CACHE:-40}" "$C_DEPTH" "$evict"
        echo
        echo "($C_DEPTH nested calls: $(( C_DEPTH + 8 )) native frames at cudaMallocAsync; ${ITERATIONS_CACHE:-40} x 5 pairs collected.)"
        ;;
    runtime-cache)
        # Counted instruction by instruction (benches/python/lines_by_instruction.py): the
        # hooks' inclusive counts are not usable here, callgrind taking the runtime's own
        # cudaMallocAsync, called from memsnap's of the same name, for a recursion.
        evict=${EVICT:-4194304}
        pairs=$(( ${ITERATIONS_CACHE:-40} * 5 ))
        echo
        echo "**C caller through the shared runtime, cold caches** (benches/programs/hook_cost.c linked to the simulated libcudart, $evict bytes written before each pair; simulated I1 32 KiB, D1 48 KiB, LL 2 MiB): what memsnap's own instructions run and miss per allocation-free pair"
        echo
        echo "| library | memsnap | instructions per pair | D1 misses per pair: read | written | LL misses per pair: read | written | dropped | stackless |"
        echo "|---|---|---|---|---|---|---|---|---|"
        for config in none python native all; do
            for lib in "${LIBS[@]}"; do
                dir=$(mktemp -d "$WORK/run.XXXXXX")
                CG_CACHE=1 CG_INSTR=1 run_cg "$dir" "$config" "$lib" cold_loop \
                    "$OUT/hook_cost_runtime" "${ITERATIONS_CACHE:-40}" "$C_DEPTH" "$evict" >/dev/null
                row=$("$PY" benches/python/lines_by_instruction.py "$dir/cg" "$lib" "$pairs" \
                    --events Ir,D1mr,D1mw,DLmr,DLmw | awk '{ printf "%d | %s | %s | %s | %s", $1, $2, $3, $4, $5 }')
                read -r recorded dropped stackless < <(counts "$dir")
                void=$(bench_void "$recorded" "$dropped" "$stackless")
                [ -z "$void" ] || row="$void | | | |"
                echo "| ${lib#"$PWD"/} | MEMSNAP_STACKS=$config | $row | $dropped | $stackless |"
            done
        done
        echo
        echo "($C_DEPTH nested calls; ${ITERATIONS_CACHE:-40} x 5 pairs collected. Counted over every instruction of memsnap's library while the loop is collected, the writer thread's included when it runs then; not over memsnap not loaded: the lines of the program's own that memsnap's pushes out are not in it.)"
        ;;
    python-cache)
        evict=${EVICT:-4194304}
        pairs=${PAIRS_CACHE:-200}
        echo
        echo "**Python caller with cold caches** (benches/python/cold_hook.py --one: 10 Python frames deep through ctypes, $evict bytes written before each pair; simulated I1 32 KiB, D1 48 KiB, LL 2 MiB): cache lines missed inside cudaMallocAsync / cudaFreeAsync"
        echo
        # (cudaMallocAsync: its inner malloc_async; cudaFreeAsync: a jump to the driver's
        # cuMemFreeAsync, as in route python. Collection starts off; the helper's cold loop
        # turns it on and off itself.)
        cold_pairs_table "$pairs" malloc_async cuMemFreeAsync "" \
            --collect-atstart=no "$PY" benches/python/cold_hook.py --one "$pairs" $(( evict / 1024 ))
        echo
        echo "(10 Python frames at the call, under the interpreter's and libffi's native frames; $pairs pairs collected after 40,000 warm ones.)"
        ;;
    esac
done
