"""py_alloc.py: a Python program that allocates through libcudart.so.13 with ctypes, from nested
Python functions (train -> forward -> make_tensor), the way PyTorch reaches cudaMalloc from Python.
ctypes.CDLL releases the GIL around each call, as PyTorch does.

Modes (argv[1]):
  main    (default) allocations on the main thread
  thread  the same calls made from a worker threading.Thread
  wait    as main, then prints `result ready=1` and waits for the end of stdin before the
          truth lines (for `memsnap top`, which looks while it waits)

Prints `result line=N` (the line of the cudaMalloc call in make_tensor), `result function=...`,
`result file=...`, the expected live bytes/count, then the fake driver's truth lines.
The runtime is FAKE_CUDART if set, else "libcudart.so.13" from the library path.
"""

import ctypes
import os
import sys
import threading

CUDART = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
CUDART.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
CUDART.cudaMalloc.restype = ctypes.c_int
CUDART.cudaFree.argtypes = [ctypes.c_void_p]
CUDART.cudaFree.restype = ctypes.c_int

MALLOC_LINE = None
LIVE = []


def make_tensor(nbytes):
    global MALLOC_LINE
    ptr = ctypes.c_void_p()
    MALLOC_LINE = sys._getframe().f_lineno + 1
    err = CUDART.cudaMalloc(ctypes.byref(ptr), nbytes)
    if err != 0:
        raise RuntimeError(f"cudaMalloc({nbytes}) failed: {err}")
    return ptr.value


def free_tensor(ptr):
    err = CUDART.cudaFree(ctypes.c_void_p(ptr))
    if err != 0:
        raise RuntimeError(f"cudaFree failed: {err}")


def forward(batch):
    hidden = make_tensor(batch * 4096)
    out = make_tensor(batch * 1024)
    free_tensor(hidden)
    return out


def train(steps):
    for step in range(steps):
        LIVE.append((forward(step + 1), (step + 1) * 1024))


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "main"
    if mode == "thread":
        worker = threading.Thread(target=train, args=(3,), name="alloc-worker")
        worker.start()
        worker.join()
    elif mode in ("main", "wait"):
        train(3)
    else:
        sys.exit(f"unknown mode {mode}")
    print(f"result mode={mode}")
    print(f"result line={MALLOC_LINE}")
    print("result function=make_tensor")
    print("result callers=forward,train")
    print(f"result file={os.path.abspath(__file__)}")
    print(f"result expected_live_bytes={sum(size for _, size in LIVE)}")
    print(f"result expected_live_count={len(LIVE)}")
    sys.stdout.flush()
    if mode == "wait":
        print("result ready=1", flush=True)
        sys.stdin.read()
    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.fake_cuda_print_truth_fd(1)


if __name__ == "__main__":
    main()
