"""Run by tests/stacks_python.rs with LD_PRELOAD=libcountmalloc.so: the steady-state capture
(Python + native frames, GIL released by ctypes) makes no malloc-family call.
Usage: python3 no_alloc_check.py path/to/libmemsnap.so"""
import ctypes
import sys
import threading

lib = ctypes.CDLL(sys.argv[1])
counted = lib.memsnap_debug_capture_counted
counted.restype = ctypes.c_uint64
counted.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
counter = ctypes.cast(ctypes.CDLL(None).count_malloc_get, ctypes.c_void_p)
get = ctypes.CDLL(None).count_malloc_get
get.restype = ctypes.c_uint64


def nested(n, mode):
    if n == 0:
        out = (ctypes.c_uint64 * 2)()
        allocs = counted(mode, 1000, counter, out)
        return allocs, out[0], out[1]
    return nested(n - 1, mode)


results = []
for mode in (1, 2, 3):
    results.append(nested(8, mode))
# A fresh thread: its first capture sets up (allocates), later ones must not.
t = threading.Thread(target=lambda: results.append(nested(5, 3)))
t.start()
t.join()
# The counter works at all: a Python list of many objects allocates through malloc.
before = get()
junk = [bytearray(1 << 16) for _ in range(4)]
moved = get() - before
for allocs, native, python in results:
    print(f"allocs={allocs} native={native} python={python}")
print(f"counter moved by {moved} for 4 large bytearrays")
ok = moved >= 4 and all(a == 0 for a, _, _ in results)
python_modes = [results[0], results[2], results[3]]
ok = ok and all(p >= 6 for _, _, p in python_modes) and results[1][1] >= 5 and results[2][1] >= 5
print("OK" if ok else "FAIL")
sys.exit(0 if ok else 1)
