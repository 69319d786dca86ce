# What the shell benchmarks (benches/*.sh) share. Sourced in the repository's root, under
# set -euo pipefail; defines functions only.

# bench_python: the interpreter $PYTHON (python3) names, itself, not a launcher script
# (pyenv's shims): valgrind follows the process it starts, and only that one.
bench_python() { "${PYTHON:-python3}" -c 'import sys; print(sys.executable)'; }

# bench_clean_env: only the settings each run names, none of the caller's (no preload, no
# MEMSNAP_*).
bench_clean_env() {
    # shellcheck disable=SC2046
    unset LD_PRELOAD $(env | grep -o '^MEMSNAP_[A-Z_]*' || true)
}

# bench_simulated_driver OUT: the simulated driver (scripts/build-fake-cuda.sh) in OUT/fake-cuda,
# the C caller benches/programs/hook_cost.c (the simulated runtime compiled in) as OUT/hook_cost,
# and the environment that finds them (LD_LIBRARY_PATH, FAKE_CUDART).
bench_simulated_driver() {
    local out=$1
    bash scripts/build-fake-cuda.sh "$out/fake-cuda" >/dev/null
    cc -std=gnu11 -O2 -g -o "$out/hook_cost" benches/programs/hook_cost.c \
        -DFAKE_CUDART_STATIC tests/fake_cuda/fake_cudart.c -ldl -lpthread
    export LD_LIBRARY_PATH=$PWD/$out/fake-cuda/lib FAKE_CUDART=$PWD/$out/fake-cuda/lib/libcudart.so.13
}

# The reader of what a run recorded (its exit snapshot in a folder of its own):
# `python3 "$BENCH_COUNTS" FOLDER` prints "<recorded> <dropped> <stackless>", or "missing".
BENCH_COUNTS=benches/python/snapshot_counts.py

# bench_void RECORDED DROPPED STACKLESS [CALLS]: the VOID text that replaces the figure of a
# run that lost anything (no snapshot, an event dropped or without its stack, or, given the
# CUDA calls the program made, fewer events recorded); nothing for a run that lost nothing.
bench_void() {
    local recorded=$1 dropped=$2 stackless=$3 calls=${4:-}
    if [ "$recorded" = missing ] || [ "$dropped" != 0 ] || [ "$stackless" != 0 ] \
        || { [ -n "$calls" ] && [ "$recorded" -lt "$calls" ]; }; then
        echo "VOID (recorded $recorded${calls:+ of $calls}, dropped $dropped, stackless $stackless)"
    fi
}

# bench_machine: "<cores> cores, <architecture>, <processor model>" for a run's header.
bench_machine() {
    echo "$(nproc) cores, $(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
}

# bench_commit [PATH...]: the commit measured, and whether PATHs (all by default) differ from it.
bench_commit() {
    echo "$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- "$@" 2>/dev/null || echo ' (+ uncommitted changes)')"
}
