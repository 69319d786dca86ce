"""py_exec.py: a Python program that allocates through libcudart.so.13 with ctypes, then replaces
its image with os.exec* (what job wrappers that re-exec themselves do).

Modes (argv[1]): execv (default), execve, execvp, execvpe. The new image is the same interpreter
running `-c` code that prints `result after_pid=PID`; it allocates nothing.

Prints `result before_pid=PID` (flushed: exec keeps no buffer). 3 MiB are live at the exec, in
two allocations (1 MiB and 2 MiB).
"""

import ctypes
import os
import sys

CUDART = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
CUDART.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
CUDART.cudaMalloc.restype = ctypes.c_int

MIB = 1 << 20


def alloc(nbytes):
    ptr = ctypes.c_void_p()
    err = CUDART.cudaMalloc(ctypes.byref(ptr), nbytes)
    if err != 0:
        raise RuntimeError(f"cudaMalloc({nbytes}) failed: {err}")
    return ptr.value


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "execv"
    kept = [alloc(MIB), alloc(2 * MIB)]
    assert all(kept)
    print(f"result before_pid={os.getpid()}", flush=True)
    argv = [sys.executable, "-c", "import os; print(f'result after_pid={os.getpid()}')"]
    if mode == "execv":
        os.execv(sys.executable, argv)
    elif mode == "execve":
        os.execve(sys.executable, argv, os.environ)
    elif mode == "execvp":
        os.execvp(sys.executable, argv)
    elif mode == "execvpe":
        os.execvpe(sys.executable, argv, os.environ)
    raise SystemExit(f"unknown mode {mode}")


main()
