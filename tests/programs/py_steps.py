"""py_steps.py: the scripts/memsnap.py module from a Python program (PYTHONPATH=scripts).

Prints `result active_before=` (memsnap.active() before any CUDA call), then allocates through
the fake runtime with ctypes, calls memsnap.step() three times (one 1 MiB allocation kept per
step), memsnap.dump("mid") and prints each return value, memsnap.active(), memsnap.loaded()
and memsnap.last_dump_path(). Also calls memsnap.step() from 4 threads at once (8 calls each)
and prints how many returned True (`result thread_steps=`).
"""

import ctypes
import os
import sys
import threading

import memsnap

CUDART = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
CUDART.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
CUDART.cudaMalloc.restype = ctypes.c_int

print(f"result module={os.path.abspath(memsnap.__file__)}")
print(f"result active_before={memsnap.active()}")
kept = []
steps = []
for k in range(3):
    ptr = ctypes.c_void_p()
    if CUDART.cudaMalloc(ctypes.byref(ptr), 1 << 20) != 0:
        sys.exit("cudaMalloc failed")
    kept.append(ptr.value)
    steps.append(memsnap.step())
print(f"result step_returns={','.join(str(s) for s in steps)}")
print(f"result active={memsnap.active()}")
print(f"result loaded={memsnap.loaded()}")
print(f"result dump_return={memsnap.dump('mid')}")
print(f"result last_dump_path={memsnap.last_dump_path()}")

ok = []
lock = threading.Lock()


def worker():
    for _ in range(8):
        r = memsnap.step()
        with lock:
            ok.append(r)


threads = [threading.Thread(target=worker) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(f"result thread_steps={sum(1 for r in ok if r)}")
sys.stdout.flush()
