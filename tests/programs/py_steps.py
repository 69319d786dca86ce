"""py_steps.py: the `memsnap` Python package from a Python program (PYTHONPATH=python, or
the package installed from the wheel).

Prints `result frameworks=` (framework modules that `import memsnap` loaded: none expected),
`result active_before=` (memsnap.active() before any CUDA call), then allocates through the
fake runtime with ctypes, calls memsnap.step() three times (one 1 MiB allocation kept per
step), memsnap.dump("mid") and prints each return value, memsnap.active() and
memsnap.loaded(). Calls the C function memsnap_dump_path directly with an 8-byte buffer
(`result cut_length=`, `result cut_bytes=`), when the library is loaded. Also calls
memsnap.step() from 4 threads at once (8 calls each) and prints how many returned True
(`result thread_steps=`).
"""

import ctypes
import os
import sys
import threading

import memsnap

CUDART = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
CUDART.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
CUDART.cudaMalloc.restype = ctypes.c_int

FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "transformers", "jax", "numpy")
print(f"result frameworks={','.join(m for m in FRAMEWORKS if m in sys.modules)}")
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

dump_path = getattr(ctypes.CDLL(None), "memsnap_dump_path", None)
if dump_path is not None:
    dump_path.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    dump_path.restype = ctypes.c_int
    cut = ctypes.create_string_buffer(b"\xff" * 16)
    print(f"result cut_length={dump_path(b'cut', cut, 8)}")
    print(f"result cut_bytes={cut.raw[:9].hex()}")

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
