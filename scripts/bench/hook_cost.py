"""What a recorded allocation costs from Python: N cudaMallocAsync + cudaFreeAsync pairs
through ctypes (which releases the GIL, as PyTorch does) from a 10-frame Python stack, on
the simulated runtime ($FAKE_CUDART). Prints the best-of-5 nanoseconds per pair.

    python3 hook_cost.py [pairs=100000]
"""
import ctypes
import os
import sys
import time

rt = ctypes.CDLL(os.environ["FAKE_CUDART"])
malloc_async = rt.cudaMallocAsync
malloc_async.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
free_async = rt.cudaFreeAsync
free_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p]


def timed_pairs(pairs):
    p = ctypes.c_void_p()
    ref = ctypes.byref(p)
    start = time.perf_counter_ns()
    for _ in range(pairs):
        malloc_async(ref, 4096, None)
        free_async(p, None)
    return (time.perf_counter_ns() - start) / pairs


def nested(depth, pairs):
    if depth <= 1:
        return timed_pairs(pairs)
    return nested(depth - 1, pairs) + 0.0


def main():
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
    # module level + main + 8 x nested + timed_pairs = 10 Python frames at the call
    nested(8, 10000)
    print(f"{min(nested(8, pairs) for _ in range(5)):.1f}")


main()
