#!/usr/bin/env bash
# validate-host.sh [LIB]: the host-behaviour fault shapes on the fake CUDA driver, with
# figures (docs/VALIDATION.md, "Host behaviour on the fake driver"). No GPU. Needs `cargo
# build` (LIB defaults to target/debug/libmemsnap.so) and the fake driver (built here into
# target/tmp/fake-cuda).
#
#   1. SIGTERM, SIGSEGV (sent) and SIGTERM twice (5 ms apart) to `load T wait` while T threads
#      allocate at full speed, T = 1..32: time from the first kill to the reaped exit, the exit
#      status, and the snapshot files written.
#   2. forked children (`fork_signal MODE 4`): four children of a recording parent ended
#      together (Pool(4).terminate()), and a child that records.
#   3. `crash double-term` and `crash two-faults`, ten tries each: files written.
#   4. exec (`exec MODE`): a recording program that replaces its image through each hooked
#      function, an exec that fails, a fork()ed and a vfork()ed child that exec, SIGUSR1
#      ignored across the exec: the time, the results and the files written.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LIB=${1:-$ROOT/target/debug/libmemsnap.so}
FAKE=$ROOT/target/tmp/fake-cuda
bash "$ROOT/scripts/build-fake-cuda.sh" "$FAKE" || exit 1

ms() { date +%s%N; }
elapsed() { echo $(((($2) - ($1)) / 1000000)); }
with_memsnap() { # FOLDER PROGRAM ARGS...: exec'ed, so that `$!` of `with_memsnap ... &` is
    # the program's pid, not a subshell's
    local folder=$1
    shift
    exec env -u LD_PRELOAD LD_LIBRARY_PATH="$FAKE/lib" FAKE_CUDART="$FAKE/lib/libcudart.so.13" \
        MEMSNAP_FOLDER="$folder" MEMSNAP_QUIET=1 LD_PRELOAD="$LIB" "$@"
}

echo "# 1. ending signals under load (load T wait)"
for shape in TERM SEGV TERMx2; do
    for threads in 1 2 4 8 16 32; do
        dir=$(mktemp -d)
        out=$dir/.out
        (with_memsnap "$dir" "$FAKE/bin/load" "$threads" wait >"$out" 2>/dev/null) &
        pid=$!
        until grep -q "result ready=1" "$out" 2>/dev/null; do sleep 0.01; done
        t0=$(ms)
        case $shape in
        TERM) kill -TERM "$pid" ;;
        SEGV) kill -SEGV "$pid" ;;
        TERMx2) kill -TERM "$pid"; sleep 0.005; kill -TERM "$pid" 2>/dev/null ;;
        esac
        wait "$pid"
        status=$?
        t1=$(ms)
        files=$(find "$dir" -maxdepth 1 -name '*.pickle' | wc -l)
        echo "$shape threads=$threads status=$status die_ms=$(elapsed "$t0" "$t1") files=$files" \
            "names=$(cd "$dir" && ls -- *.pickle 2>/dev/null | sed 's/.*-p[0-9]*-//' | tr '\n' ' ')"
        rm -rf "$dir"
    done
done

echo "# 2. forked children (fork_signal MODE CHILDREN)"
for args in "term 4" "segv 4" "abort 4" "record-term 1" "record-segv 1"; do
    dir=$(mktemp -d)
    # shellcheck disable=SC2086
    result=$( (with_memsnap "$dir" "$FAKE/bin/fork_signal" $args 2>/dev/null) | grep -E "died_ms|child_signal" | tr '\n' ' ')
    echo "fork_signal $args: $result files=$(find "$dir" -maxdepth 1 -name '*.pickle' | wc -l)"
    rm -rf "$dir"
done

echo "# 3. two ending signals at once (crash MODE), ten tries each"
for mode in double-term two-faults; do
    kept=0
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        dir=$(mktemp -d)
        t0=$(ms)
        (with_memsnap "$dir" "$FAKE/bin/crash" "$mode" >/dev/null 2>&1)
        status=$?
        t1=$(ms)
        n=$(find "$dir" -maxdepth 1 \( -name '*-term-*' -o -name '*-crash-*' \) | wc -l)
        kept=$((kept + n))
        rm -rf "$dir"
    done
    echo "crash $mode: snapshots in 10 tries=$kept last_status=$status last_die_ms=$(elapsed "$t0" "$t1")"
done

echo "# 4. exec (exec MODE)"
for args in execv execve execvp execvpe fexecve execveat execl execlp execle reexec "missing execv" \
    "missing execle" fork vfork ignored "ignored missing"; do
    dir=$(mktemp -d)
    t0=$(ms)
    # shellcheck disable=SC2086
    result=$( (with_memsnap "$dir" "$FAKE/bin/exec" $args 2>/dev/null) | grep -E "^result (exec_rc|exec_enoent|child_ms|after_usr1_ignored|signal_snapshot)" | sed 's/^result //' | tr '\n' ' ')
    t1=$(ms)
    echo "exec $args: ms=$(elapsed "$t0" "$t1") $result exec_files=$(find "$dir" -maxdepth 1 -name '*-exec-[0-9]*.pickle' | wc -l) files=$(find "$dir" -maxdepth 1 -name '*.pickle' | wc -l)"
    rm -rf "$dir"
done
