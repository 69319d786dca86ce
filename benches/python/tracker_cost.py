"""tracker_cost.py: tracker_cost.c's rounds from Python, through ctypes into the PyTorch
stand-in ($STANDIN_LIB), 12 Python frames deep at the call (counted by the script), for
benches/hook-instructions.sh. The interpreter is the caller, as in PyTorch: each
standin_malloc / standin_free / standin_process_events is one phase that callgrind collects
alone.

    python3 tracker_cost.py ROUNDS

Prints one line: "<tracker calls under standin_malloc> <under standin_free> <under
standin_process_events> <Python frames at the call>".
"""
import ctypes
import os
import sys

SITES, BATCH, SIDE_STREAM = 6, 64, 0x7001
PY_FRAMES = 12

rt = ctypes.CDLL(os.environ["FAKE_CUDART"], mode=ctypes.RTLD_GLOBAL)
first = ctypes.c_void_p()
if rt.cudaMalloc(ctypes.byref(first), ctypes.c_size_t(4096)) != 0 or rt.cudaFree(first) != 0:
    sys.exit("tracker_cost.py: cudaMalloc failed")
lib = ctypes.CDLL(os.environ["STANDIN_LIB"])
lib.standin_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t]
lib.standin_malloc.restype = ctypes.c_void_p
lib.standin_free.argtypes = [ctypes.c_void_p]
lib.standin_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
lib.standin_tracker_calls.restype = ctypes.c_ulonglong
lib.standin_init(1)
counts = [0, 0, 0]
state = {"frames": 0}


def _alloc(size):
    before = lib.standin_tracker_calls()
    p = lib.standin_malloc(size, 0, 0)
    counts[0] += lib.standin_tracker_calls() - before
    if not p:
        sys.exit("tracker_cost.py: standin_malloc failed")
    return p


def _free(p):
    before = lib.standin_tracker_calls()
    lib.standin_free(p)
    counts[1] += lib.standin_tracker_calls() - before


def alloc0(s): return _alloc(s)
def alloc1(s): return _alloc(s)
def alloc2(s): return _alloc(s)
def alloc3(s): return _alloc(s)
def alloc4(s): return _alloc(s)
def alloc5(s): return _alloc(s)
def free0(p): _free(p)
def free1(p): _free(p)
def free2(p): _free(p)
def free3(p): _free(p)
def free4(p): _free(p)
def free5(p): _free(p)


ALLOC = [alloc0, alloc1, alloc2, alloc3, alloc4, alloc5]
FREE = [free0, free1, free2, free3, free4, free5]


def rounds(n):
    state["frames"] = _frames()
    for _ in range(n):
        blocks = [ALLOC[i % SITES](512 + (i * 7 % 32) * 512) for i in range(BATCH)]
        for p in blocks:
            lib.standin_record_stream(p, SIDE_STREAM)
        for i, p in enumerate(blocks):
            FREE[i % SITES](p)
        before = lib.standin_tracker_calls()
        lib.standin_process_events()
        counts[2] += lib.standin_tracker_calls() - before


def _frames():
    """The Python frames at the standin_malloc call (_alloc's and alloc<n>'s included)."""
    f, n = sys._getframe(1), 2  # rounds, plus alloc<n> and _alloc instead of this one
    while f is not None:
        n += 1
        f = f.f_back
    return n


def nested(depth, n):
    if depth <= 0:
        rounds(n)
        return
    nested(depth - 1, n)


# <module> + nested x (PY_FRAMES - 4) + rounds + alloc<n> + _alloc = PY_FRAMES
nested(PY_FRAMES - 5, int(sys.argv[1]) if len(sys.argv) > 1 else 50)
print(counts[0], counts[1], counts[2], state["frames"])
