# Sourced by benches/real-torch.sh and benches/real-torch-step.sh (bash, set -euo
# pipefail, in the repository's root, with ROOT and NAME, the calling script's name, set and
# the script's arguments, libmemsnap.so builds, still in "$@"). Checks valgrind and the
# libraries (LIBS: the arguments, made absolute, or target/gpu's bench-hooks build, built
# here; with PASS_THROUGH=1, that each has the bench-hooks switch), sets up the real PyTorch
# (REAL_TORCH_DIR, TORCH_VERSION, PYTHON) and its environment with no MEMSNAP_* setting of
# the caller's, and leaves PY (the interpreter itself), WORK (a folder removed at exit),
# WORK/helper.so (callgrind's client requests as C functions), counted_process (with the
# caller's PROGRAM and PROGRAM_ARGS) and count_configurations.
. "$ROOT/benches/support/common.sh"
DIR=${REAL_TORCH_DIR:-$ROOT/target/real-torch}
LIBS=("$@")
[ $# -gt 0 ] || LIBS=("$ROOT/target/gpu/release/libmemsnap.so")
PYTHON=${PYTHON:-python3}
command -v valgrind >/dev/null || { echo "$NAME: needs valgrind" >&2; exit 2; }
[ -f /usr/include/valgrind/callgrind.h ] || { echo "$NAME: needs valgrind's headers (valgrind/callgrind.h)" >&2; exit 2; }
if [ $# -eq 0 ]; then
    cargo build --release --lib --features bench-hooks --target-dir target/gpu
fi
for i in "${!LIBS[@]}"; do
    lib=${LIBS[$i]}
    [ -f "$lib" ] || { echo "$NAME: no file $lib" >&2; exit 2; }
    LIBS[$i]=$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")
    [ "${PASS_THROUGH:-0}" = 0 ] || nm -D --defined-only "$lib" | grep ' memsnap_debug_pass_through$' >/dev/null \
        || { echo "$NAME: $lib has no memsnap_debug_pass_through (build it with --features bench-hooks)" >&2; exit 2; }
done
PYTHON=$PYTHON bash scripts/real-torch/setup.sh "$DIR" "${TORCH_VERSION:-2.11.0}" >&2
bench_clean_env
# shellcheck disable=SC1091
. "$DIR/env.sh"
PY=$(bench_python)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/helper.c" <<'C'
#include <valgrind/callgrind.h>
void counted_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void counted_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void counted_zero(void) { CALLGRIND_ZERO_STATS; }
void counted_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
C
cc -O2 -fPIC -shared -o "$WORK/helper.so" "$WORK/helper.c"

# counted_process NAME MODE STACKS [ENV...]: one process of the calling script's PROGRAM
# (given WORK/helper.so MODE STACKS, then PROGRAM_ARGS) under callgrind with ENV, counting from
# its client request on, each thread apart: WORK/NAME/cg.PID*, out.txt (its output),
# valgrind.txt and snapshots/ (memsnap's folder). A process that fails ends the script.
counted_process() {
    local name=$1 mode=$2 stacks=$3
    shift 3
    mkdir -p "$WORK/$name/snapshots"
    # (The same hash seed in every process: the interpreter's own instructions then do not move
    # between processes, and a block of one process can be set against another's.)
    env "$@" PYTHONHASHSEED=0 MEMSNAP_FOLDER="$WORK/$name/snapshots" valgrind --tool=callgrind \
        --instr-atstart=no --separate-threads=yes --callgrind-out-file="$WORK/$name/cg.%p" \
        "$PY" "${PROGRAM[@]}" "$WORK/helper.so" "$mode" "$stacks" "${PROGRAM_ARGS[@]}" \
        > "$WORK/$name/out.txt" 2> "$WORK/$name/valgrind.txt" \
        || { echo "$NAME: $name failed:" >&2; tail -n 20 "$WORK/$name/valgrind.txt" >&2; exit 1; }
}

# count_configurations RECORDER_STACKS: the calling script's `count NAME MODE STACKS [ENV...]`
# for every configuration: each route (PyTorch's caching allocator; tensor mode, named
# tensor-...) without memsnap and with each library of LIBS (named @FOLDER when there are
# several) in each stacks mode of STACKS, then PyTorch's recorder, caching allocator only,
# with each stacks mode of RECORDER_STACKS.
count_configurations() {
    local route prefix lib label stacks
    local conf=()
    for route in caching tensor; do
        conf=()
        prefix=""
        if [ $route = tensor ]; then
            conf=(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)
            prefix="tensor-"
        fi
        count "${prefix}plain" plain - "${conf[@]}"
        for lib in "${LIBS[@]}"; do
            label=""
            [ ${#LIBS[@]} -eq 1 ] || label="@$(basename "$(dirname "$lib")")"
            for stacks in $STACKS; do
                count "${prefix}memsnap-$stacks$label" memsnap "$stacks" "${conf[@]}" LD_PRELOAD="$lib" MEMSNAP_STACKS="$stacks"
            done
        done
    done
    for stacks in $1; do
        count "recorder-$stacks" recorder "$stacks"
    done
}
