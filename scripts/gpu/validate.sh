#!/usr/bin/env bash
# memsnap on a real GPU: every case of docs/VALIDATION.md, then the overhead bench
# (benches/gpu/bench_overhead.py, run as a program: nothing here imports from benches/).
#
#   OUT=/some/folder bash scripts/gpu/validate.sh        (from the repo root, on the GPU machine)
#
# Needs target/release/libmemsnap.so and target/release/memsnap (built elsewhere, carried over),
# nvcc, python3 with torch, jax, cupy. Writes exactly three files into $OUT:
#   results.json        one record per case (name, ok, status, checks, measured, details, error),
#                       the environment, and "overhead" (the bench)
#   log.txt             all output, truncated in the middle if very long
#   snapshots.tar.gz    a bounded selection of the snapshot files and per-case JSON records
# Exits 0 only if every case passed (or was skipped) and the bench ran.
#
# Knobs (environment): CASES="a_cuda_static ..." (default all; empty = none), BENCH=0 to skip the
# bench, TOTAL_S (default 460: cases + bench), BENCH_S (default 170), MEMSNAP_LIB, MEMSNAP_CLI,
# MEMSNAP_VALIDATE_WORK (work folder, default a fresh one under /tmp).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
ROOT=$PWD
OUT=${OUT:-/tmp/memsnap-validate-out}
mkdir -p "$OUT"
WORK=${MEMSNAP_VALIDATE_WORK:-$(mktemp -d /tmp/memsnap-validate.XXXXXX)}
mkdir -p "$WORK"
LIB=${MEMSNAP_LIB:-$ROOT/target/release/libmemsnap.so}
CLI=${MEMSNAP_CLI:-$ROOT/target/release/memsnap}
ALL_CASES="a_cuda_static a_cuda_shared b_torch_caching c_torch_async d_torch_expandable d_torch_nocache e_jax e_cupy f_torch_oom g_torchrun h_memviz"
CASES=${CASES-$ALL_CASES}
BENCH=${BENCH:-1}
TOTAL_S=${TOTAL_S:-460}
BENCH_S=${BENCH_S:-170}
H_RESERVE=45 # seconds kept for h_memviz at the end of the cases
PY=${PYTHON:-python3}
G=scripts/gpu
B=benches/gpu
# NVLink multicast stays off on the lent machines (it can take shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset LD_PRELOAD
START=$(date +%s)
START_ISO=$(date -u +%Y-%m-%dT%H:%M:%SZ)
LOG=$WORK/full.log

case_timeout() { # own limit of each case in seconds
  case $1 in
    a_cuda_*) echo 60 ;;
    e_jax | g_torchrun) echo 150 ;;
    h_memviz) echo 180 ;;
    *) echo 100 ;;
  esac
}

main() {
  echo "memsnap GPU validation: $START_ISO  repo=$ROOT  work=$WORK  out=$OUT"
  echo "lib=$LIB ($(test -f "$LIB" && echo present || echo MISSING))  cli=$CLI ($(test -f "$CLI" && echo present || echo missing))"
  echo "cases: $CASES   bench: $BENCH"

  echo "== environment"
  timeout -k 5 180 "$PY" $G/collect.py env --work "$WORK" --lib "$LIB" --cli "$CLI"
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    NGPU=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true)
  fi
  export NGPU=${NGPU:-0}
  echo "GPUs visible: $NGPU"

  if echo " $CASES " | grep -q ' a_cuda_'; then
    echo "== building the CUDA test programs"
    mkdir -p "$WORK/bin"
    # both at once: plain nvcc links cudart statically (its default); the other uses libcudart.so
    (timeout -k 5 180 nvcc -O1 -g -o "$WORK/bin/alloc_static" $G/alloc_test.cu 2>&1 ||
      echo "nvcc (static cudart) FAILED") &
    (timeout -k 5 180 nvcc -O1 -g -cudart shared -o "$WORK/bin/alloc_shared" $G/alloc_test.cu 2>&1 ||
      echo "nvcc (-cudart shared) FAILED") &
    wait
    ls -l "$WORK/bin" 2>&1
    for b in alloc_static alloc_shared; do
      test -f "$WORK/bin/$b" && { echo "ldd $b:"; ldd "$WORK/bin/$b" 2>&1 | grep -i -E 'cuda|not found' || true; }
    done
  fi

  local reserve=0
  [ "$BENCH" = "1" ] && reserve=$BENCH_S
  local case_deadline=$((START + TOTAL_S - reserve))
  for c in $CASES; do
    mkdir -p "$WORK/$c"
    local now limit own extra=()
    now=$(date +%s)
    own=$(case_timeout "$c")
    if [ "$c" = h_memviz ]; then
      limit=$((case_deadline - now))
    else
      limit=$((case_deadline - H_RESERVE - now))
    fi
    [ "$limit" -gt "$own" ] && limit=$own
    if [ "$limit" -lt 15 ]; then
      echo "== $c: NOT RUN (time budget used up)"
      echo "not run: validate.sh time budget (TOTAL_S=$TOTAL_S) used up" >"$WORK/$c/not_run.txt"
      echo skipped >"$WORK/$c/rc.txt"
      continue
    fi
    case $c in
      a_cuda_static) extra=(--bin "$WORK/bin/alloc_static") ;;
      a_cuda_shared) extra=(--bin "$WORK/bin/alloc_shared") ;;
    esac
    echo
    echo "######## $c (limit ${limit}s) $(date -u +%H:%M:%S)"
    timeout -k 10 "$limit" "$PY" $G/cases.py "$c" --root "$WORK" --lib "$LIB" --cli "$CLI" \
      --timeout $((limit > 30 ? limit - 12 : limit - 5)) "${extra[@]}"
    echo $? >"$WORK/$c/rc.txt"
  done

  if [ "$BENCH" = "1" ]; then
    local left=$((START + TOTAL_S - $(date +%s)))
    [ "$left" -gt "$BENCH_S" ] && left=$BENCH_S
    echo
    echo "######## overhead bench (budget ${left}s) $(date -u +%H:%M:%S)"
    if [ "$left" -ge 40 ]; then
      timeout -k 10 $((left + 30)) "$PY" $B/bench_overhead.py driver --lib "$LIB" --work "$WORK/bench" \
        --result "$WORK/bench.json" --budget "$left"
      echo "bench exit status $?"
    else
      echo "bench NOT RUN: time budget used up"
    fi
  fi

  echo
  echo "######## results $(date -u +%H:%M:%S)"
  timeout -k 5 120 "$PY" $G/collect.py results --work "$WORK" --out "$OUT" --cases "$CASES" \
    --bench "$BENCH" --started "$START_ISO"
  local st=$?
  echo "validate.sh finished in $(($(date +%s) - START))s with status $st; work folder $WORK"
  return $st
}

main 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
"$PY" $G/collect.py log --src "$LOG" --dst "$OUT/log.txt" || cp "$LOG" "$OUT/log.txt"
if [ ! -f "$OUT/results.json" ]; then
  echo '{"ok": false, "error": "collect.py wrote no results.json; see log.txt"}' >"$OUT/results.json"
  [ "$status" = 0 ] && status=1
fi
exit "$status"
