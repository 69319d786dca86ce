"""py_helper.py: a training loop whose allocations go through helpers, for the site rules
(docs/EXPLAIN.md, "Sites"). Allocates through libcudart.so.13 with ctypes, as py_alloc.py.
Each line the tests look for ends in a `# LINE: name` comment.

- `alloc`: called from two lines of `step` (2 MiB and 1 MiB a step, freed the next step).
- `Cache.get` calls `_new_block`, its only caller: one helper whose calling lines are `step`'s
  (3 MiB a step under a new key, never freed: the leak) and `evaluate`'s (16 MiB, once).
- `load_weights`: 16 MiB from its one caller.
- A module-level line calls `fakelib.block` (a library the program writes under
  ./site-packages), which allocates 128 MiB from each of two of its own lines.

Prints the driver's truth lines at the end.
"""

import ctypes
import importlib
import os
import sys

MIB = 1 << 20
STEPS = 20
FAKELIB = '''
import ctypes, os
RT = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
RT.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]


def dropout(n):
    p = ctypes.c_void_p()
    assert RT.cudaMalloc(ctypes.byref(p), n) == 0
    return p.value


def linear(n):
    p = ctypes.c_void_p()
    assert RT.cudaMalloc(ctypes.byref(p), n) == 0
    return p.value


def block(n):
    return [dropout(n), linear(n)]
'''


def runtime():
    rt = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    rt.cudaMalloc.restype = ctypes.c_int
    rt.cudaFree.argtypes = [ctypes.c_void_p]
    rt.cudaFree.restype = ctypes.c_int
    return rt


CUDART = runtime()


def checked(err, ptr):
    if err != 0:
        raise RuntimeError(f"cudaMalloc failed: {err}")
    return ptr.value


def alloc(nbytes):
    ptr = ctypes.c_void_p()
    return checked(CUDART.cudaMalloc(ctypes.byref(ptr), nbytes), ptr)  # LINE: alloc


class Cache:
    def __init__(self):
        self.blocks = {}

    def _new_block(self, nbytes):
        ptr = ctypes.c_void_p()
        return checked(CUDART.cudaMalloc(ctypes.byref(ptr), nbytes), ptr)  # LINE: new_block

    def get(self, key, nbytes):
        if key not in self.blocks:
            self.blocks[key] = self._new_block(nbytes)  # LINE: get
        return self.blocks[key]


def load_weights():
    ptr = ctypes.c_void_p()
    return checked(CUDART.cudaMalloc(ctypes.byref(ptr), 16 * MIB), ptr)  # LINE: weights


def step(cache, k, temps):
    for t in temps:
        if CUDART.cudaFree(ctypes.c_void_p(t)) != 0:
            raise RuntimeError("cudaFree failed")
    cache.get(("batch", k), 3 * MIB)  # LINE: keep
    a = alloc(2 * MIB)  # LINE: temp1
    b = alloc(1 * MIB)  # LINE: temp2
    return [a, b]


def evaluate(cache):
    return cache.get("eval", 16 * MIB)  # LINE: eval


def train():
    """Writes fakelib.py under ./site-packages (a library's folder), runs the loop, and
    returns the library."""
    os.makedirs("site-packages", exist_ok=True)
    with open("site-packages/fakelib.py", "w") as f:
        f.write(FAKELIB)
    sys.path.insert(0, os.path.abspath("site-packages"))
    cache = Cache()
    temps = []
    load_weights()
    for k in range(STEPS):
        temps = step(cache, k, temps)
    evaluate(cache)
    return importlib.import_module("fakelib")


fakelib = train()
kept = fakelib.block(128 * MIB)  # LINE: module
ctypes.CDLL("libcuda.so.1").fake_cuda_print_truth_fd(1)
