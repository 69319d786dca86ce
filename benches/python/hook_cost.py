"""What a recorded allocation costs from Python, in a training-loop-like pattern, on the
simulated runtime ($FAKE_CUDART) through ctypes (which releases the GIL, as PyTorch does).

Each iteration frees the oldest of WINDOW live allocations and allocates a new one
(cudaFreeAsync + cudaMallocAsync: two events), from one of SITES distinct call sites in
rotation (distinct functions, so distinct Python stacks), with a size drawn from a fixed table
of 256 sizes (512 B .. 64 MiB) by a deterministic pseudo-random sequence, 12 Python frames
deep at the call.

    python3 hook_cost.py [iterations=100000]

Prints one line: "<best-of-5 ns per iteration> <CUDA calls made> <Python frames>", where
CUDA calls made counts every successful cudaMallocAsync and cudaFreeAsync of the process
(warm-up and final drain included: what a preloaded memsnap must have recorded).
"""
import ctypes
import os
import random
import sys
import time

rt = ctypes.CDLL(os.environ["FAKE_CUDART"])
malloc_async = rt.cudaMallocAsync
malloc_async.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
malloc_async.restype = ctypes.c_int
free_async = rt.cudaFreeAsync
free_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
free_async.restype = ctypes.c_int

N_SIZES, SITES, WINDOW = 256, 6, 16
PY_FRAMES = 12
SIZES = [(int(512 * 1.0472**i) + 511) // 512 * 512 for i in range(N_SIZES)]
_rng = random.Random(20261122)
# The size sequence is drawn once (deterministic), so drawing costs nothing in the loop.
SEQUENCE = [SIZES[_rng.randrange(N_SIZES)] for _ in range(1 << 16)]

live = [ctypes.c_void_p() for _ in range(WINDOW)]
live_refs = [ctypes.byref(p) for p in live]
state = {"head": 0, "calls": 0, "frames": 0}


def _step(size):
    """Free the oldest live allocation, allocate a new one in its place."""
    h = state["head"]
    p = live[h]
    if p.value:
        if free_async(p, None) != 0:
            sys.exit("hook_cost.py: cudaFreeAsync failed")
        state["calls"] += 1
    if malloc_async(live_refs[h], size, None) != 0:
        sys.exit("hook_cost.py: cudaMallocAsync failed")
    state["calls"] += 1
    state["head"] = (h + 1) % WINDOW


# Distinct call sites: six functions, each its own frame (and line) on the Python stack.
def site0(size):
    _step(size)


def site1(size):
    _step(size)


def site2(size):
    _step(size)


def site3(size):
    _step(size)


def site4(size):
    _step(size)


def site5(size):
    _step(size)


SITE_FNS = [site0, site1, site2, site3, site4, site5]


def python_depth():
    f, n = sys._getframe(1), 0
    while f is not None:
        n, f = n + 1, f.f_back
    return n


def timed_loop(iterations):
    sites, seq, mask = SITE_FNS, SEQUENCE, len(SEQUENCE) - 1
    start = time.perf_counter_ns()
    for i in range(iterations):
        sites[i % SITES](seq[i & mask])
    return (time.perf_counter_ns() - start) / iterations


def nested(depth, iterations):
    if depth <= 1:
        return timed_loop(iterations)
    return nested(depth - 1, iterations) + 0.0


def nested_depth(depth):
    if depth <= 1:
        # python_depth() counts up to here (where nested(1) stands); + timed_loop, site<n>
        # and _step make the frames at the ctypes call
        return python_depth() + 3
    return nested_depth(depth - 1) + 0


# module level + main + NESTED x nested + timed_loop + site<n> + _step = PY_FRAMES
NESTED = PY_FRAMES - 5


def main():
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
    frames = nested_depth(NESTED)
    nested(NESTED, 10000)  # warm-up
    best = min(nested(NESTED, iterations) for _ in range(5))
    for p in live:
        if p.value:
            if free_async(p, None) != 0:
                sys.exit("hook_cost.py: cudaFreeAsync failed")
            state["calls"] += 1
    print(f"{best:.1f} {state['calls']} {frames}")


main()
