"""A whole recorded allocation with cold caches: cudaMallocAsync + cudaFreeAsync on the
simulated runtime from a Python caller 10 frames deep (through ctypes, the GIL released),
each pair after a buffer was written, so that what the hook reads (the thread's stack state,
its lane, the frames, memsnap's own tables) comes from farther out in the cache hierarchy, as
between two events of a real training step. Only the two calls are timed, after a warm-up of
40,000 pairs and a pause (past a lane's first lap, the writer caught up). Compares builds,
interleaved process by process, against the same loop without memsnap.

    python3 benches/python/cold_hook.py [--rounds 5] [--evict 0,4096] [--stacks none,python]
        [--iterations 3000] LIB.so [LIB.so ...]
    python3 benches/python/cold_hook.py --one PAIRS KIB
        (one process with whatever LD_PRELOAD and MEMSNAP_* it was given: the warm-up, then
        PAIRS pairs with KIB written before each; run under valgrind --tool=callgrind
        --collect-atstart=no, only those pairs are collected)

Needs a C compiler (cc) and the simulated runtime: `bash scripts/build-fake-cuda.sh DIR`,
then FAKE_CUDART=DIR/lib/libcudart.so.13 and LD_LIBRARY_PATH=DIR/lib in the environment
(benches/hook-instructions.sh builds it in target/bench-hooks/fake-cuda). Each figure:
ns per pair (one allocation with its stack, one free without) over the same loop in a
process without memsnap, median over rounds (lowest..highest round). Every memsnap process's
exit snapshot must say 0 dropped and 0 stackless, else its figure is VOID.
"""
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

WARM_UP_PAIRS = 40_000
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cold_common import arguments, compile_helper, median_range, python_deep  # noqa: E402
from snapshot_counts import read_counts  # noqa: E402

C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
/* Under callgrind (--collect-atstart=no) only the cold pairs are collected: the loop of
   cold_pairs turns collection on and off with callgrind's client requests, which are a few
   instructions that do nothing outside valgrind. (Callgrind does not name this helper's
   functions when Python loads it through ctypes, so --toggle-collect cannot find them.) */
#if defined(__has_include)
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define COLLECT_TOGGLE() CALLGRIND_TOGGLE_COLLECT
#endif
#endif
#ifndef COLLECT_TOGGLE
#define COLLECT_TOGGLE() ((void)0)
#define COLLECT_TOGGLES 0
#else
#define COLLECT_TOGGLES 1
#endif
/* 1 where the helper was built with callgrind's client requests. */
int collect_toggles(void) { return COLLECT_TOGGLES; }
typedef int (*malloc_t)(void **, size_t, void *);
typedef int (*free_t)(void *, void *);
static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}
/* The warm-up's pairs: nothing written between them, nothing timed, nothing collected. */
__attribute__((noinline)) int warm_pairs(long iterations, malloc_t m, free_t f) {
    for (long i = 0; i < iterations; i++) {
        void *p = 0;
        if (m(&p, 1 << 20, 0) != 0 || f(p, 0) != 0) return -1;
    }
    return 0;
}
/* ns inside the calls over `iterations` pairs, less the cost of an empty timed interval. */
__attribute__((noinline)) double cold_pairs(long iterations, long evict_bytes, malloc_t m, free_t f) {
    long words = evict_bytes / 8 > 8 ? evict_bytes / 8 : 8;
    volatile uint64_t *buffer = calloc(words, 8);
    double inside = 0, empty = 0;
    COLLECT_TOGGLE();
    for (long i = 0; i < iterations; i++) {
        for (long w = 0; w < words; w += 8) buffer[w] += i;
        void *p = 0;
        double t0 = now_ns();
        if (m(&p, 1 << 20, 0) != 0 || f(p, 0) != 0) return -1;
        double t1 = now_ns();
        inside += t1 - t0;
        double t2 = now_ns();
        empty += now_ns() - t2;
    }
    COLLECT_TOGGLE();
    free((void *)buffer);
    return inside - empty;
}
"""


def child(helper, iterations, evict_kib):
    rt = ctypes.CDLL(os.environ["FAKE_CUDART"])
    m, f = rt.cudaMallocAsync, rt.cudaFreeAsync
    h = ctypes.CDLL(helper)
    c, warm = h.cold_pairs, h.warm_pairs
    c.restype = ctypes.c_double
    c.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    warm.restype = ctypes.c_int
    warm.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    as_ptr = lambda fn: ctypes.cast(fn, ctypes.c_void_p)  # noqa: E731
    # Warm-up, nothing written between pairs: 80,000 events, past the first lap of a lane of
    # the default 65,536 events, whose pages become resident as it is first written (a page
    # fault every 42 events that a longer-running program pays once).
    if python_deep(10, lambda: warm(WARM_UP_PAIRS, as_ptr(m), as_ptr(f))) != 0:
        sys.exit("cold_hook: a simulated CUDA call failed")
    # A warm-up that fast can fill the lane (with all stacks it outruns the writer): the
    # writer drains it before the timed pairs, which then never wait for room.
    time.sleep(1.0)
    ns = python_deep(10, lambda: c(iterations, evict_kib * 1024, as_ptr(m), as_ptr(f)))
    if ns < 0:
        sys.exit("cold_hook: a simulated CUDA call failed")
    print(json.dumps({"ns_per_pair": ns / iterations}))


def run(helper, lib, stacks, iterations, kib, folder):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSNAP_") and k != "LD_PRELOAD"}
    if lib:
        env.update(LD_PRELOAD=os.path.abspath(lib), MEMSNAP_STACKS=stacks, MEMSNAP_QUIET="1",
                   MEMSNAP_FOLDER=folder, MEMSNAP_AT_EXIT="1")
    p = subprocess.run([sys.executable, __file__, "--child", helper, str(iterations), str(kib)],
                       env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit(f"cold_hook: a run failed: {p.stderr[-500:]}")
    ns = json.loads(p.stdout.strip().splitlines()[-1])["ns_per_pair"]
    if lib:
        counts = read_counts(folder)
        if counts is None or counts["recorded"] == 0 or counts["dropped"] or counts["stackless"]:
            return None
    return ns


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        # One process, the caller of its own run, helper built here: what
        # benches/hook-instructions.sh runs under callgrind (route python-cache).
        tmp, helper = compile_helper("cold_hook", C_SOURCE)
        try:
            if ctypes.CDLL(helper).collect_toggles() != 1:
                sys.exit("cold_hook --one: needs valgrind's headers (valgrind/callgrind.h) to "
                         "collect the cold pairs alone")
            child(helper, int(sys.argv[2]), int(sys.argv[3]))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    a = arguments(__doc__, "0,4096", "none,python", "pairs")
    if "FAKE_CUDART" not in os.environ:
        sys.exit("cold_hook: set FAKE_CUDART (see the docstring)")
    tmp, helper = compile_helper("cold_hook", C_SOURCE)
    print(f"Python {sys.version.split()[0]}, {a.iterations} pairs per process, {a.rounds} rounds; "
          "ns per pair over the same loop without memsnap: median over rounds (lowest..highest)\n")
    print("| stacks | KiB written between pairs | without memsnap, ns per pair | "
          + " | ".join(a.libs) + " |")
    print("|---|---|---|" + "---|" * len(a.libs))
    for stacks in a.stacks.split(","):
        for kib in (int(k) for k in a.evict.split(",")):
            base, over = [], {lib: [] for lib in a.libs}
            for round_ in range(a.rounds):
                libs = a.libs if round_ % 2 == 0 else list(reversed(a.libs))
                b = run(helper, None, stacks, a.iterations, kib, None)
                base.append(b)
                for i, lib in enumerate(libs):
                    folder = os.path.join(tmp, f"snap-{stacks}-{kib}-{round_}-{i}")
                    ns = run(helper, lib, stacks, a.iterations, kib, folder)
                    over[lib].append(None if ns is None else ns - b)
            cells = []
            for lib in a.libs:
                v = over[lib]
                if any(x is None for x in v):
                    cells.append("VOID (lost events or stacks)")
                    continue
                cells.append(median_range(v))
            print(f"| {stacks} | {kib} | {statistics.median(base):.1f} | " + " | ".join(cells) + " |",
                  flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
