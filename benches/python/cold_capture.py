"""Stack capture with cold caches: what a capture costs when the program's own work between
two events has pushed what the capture reads out of the nearer caches, as in a real training
step, where a tight loop of captures keeps all of it in the first-level cache. Compares two
or more builds, interleaved run by run.

    python3 benches/python/cold_capture.py [--rounds 5] [--evict 0,1024,4096] [--stacks python,all]
        [--iterations 3000] LIB.so [LIB.so ...]

A LIB is a libmemsnap.so built with `--features bench-hooks`: its
memsnap_debug_bench_capture_cold entry point (src/lifecycle/debug.rs) captures the caller's
stack ITERATIONS times, each time after writing EVICT KiB of a buffer of its own, and returns
the nanoseconds inside the captures alone. The caller is this script, 10 Python frames deep,
through ctypes (the GIL released, as PyTorch's CUDA calls) and a C function 8 frames deep
(compiled here with `cc`). One figure per library, stacks setting and eviction size: the
median over rounds of the mean per capture, with the lowest and highest round.

Instruction counts do not see any of this (a cache miss is one instruction); this timing is
paired with `bash benches/hook-instructions.sh` in docs/BENCHMARKS.md.
"""
import ctypes
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cold_common import arguments, compile_helper, median_range, python_deep  # noqa: E402

C_SOURCE = r"""
#include <stdint.h>
typedef uint64_t (*bench_t)(int, int, uint64_t, uint64_t);
__attribute__((noinline)) uint64_t bench_deep(int n, bench_t f, int stacks, int max,
                                              uint64_t iterations, uint64_t evict) {
    if (n <= 0) return f(stacks, max, iterations, evict);
    uint64_t r = bench_deep(n - 1, f, stacks, max, iterations, evict);
    __asm__ volatile("" ::: "memory");
    return r;
}
"""

STACKS = {"none": 0, "python": 1, "native": 2, "all": 3}


def main():
    a = arguments(__doc__, "0,1024,4096", "python,all", "captures")
    tmp, deep_so = compile_helper("cold_capture", C_SOURCE)
    deep = ctypes.CDLL(deep_so).bench_deep
    deep.restype = ctypes.c_uint64
    deep.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                     ctypes.c_uint64, ctypes.c_uint64]
    entries = []
    for lib in a.libs:
        so = ctypes.CDLL(os.path.abspath(lib))
        entries.append((lib, ctypes.cast(so.memsnap_debug_bench_capture_cold, ctypes.c_void_p)))
    print(f"Python {sys.version.split()[0]}, {a.iterations} captures per run, {a.rounds} rounds, "
          "ns per capture: median over rounds (lowest..highest round)\n")
    print("| stacks | KiB written between captures | " + " | ".join(lib for lib, _ in entries) + " |")
    print("|---|---|" + "---|" * len(entries))
    for stacks in a.stacks.split(","):
        for kib in (int(k) for k in a.evict.split(",")):
            runs = {lib: [] for lib, _ in entries}
            for round_ in range(a.rounds):
                order = entries if round_ % 2 == 0 else list(reversed(entries))
                for lib, fn in order:
                    ns = python_deep(10, lambda: deep(8, fn, STACKS[stacks], 0, a.iterations, kib * 1024))
                    runs[lib].append(ns / a.iterations)
            cells = [median_range(runs[lib]) for lib, _ in entries]
            print(f"| {stacks} | {kib} | " + " | ".join(cells) + " |", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
