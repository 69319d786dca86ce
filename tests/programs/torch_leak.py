"""torch_leak.py: a training loop on the PyTorch 2.11 stand-in (tests/fake_torch) with one
leaking line, for checking that memsnap names the line that holds memory.

The stand-in is loaded with ctypes (RTLD_LOCAL) from STANDIN_DIR (default: ../torch beside this script's
folder, the fake-CUDA OUTDIR layout) after one unrelated cudaMalloc + cudaFree through the fake
runtime (FAKE_CUDART), so an interposer is already running when it appears. standin_init(2),
then STEPS (25) steps on device 0: `forward` allocates a 4 MiB temporary and frees it, and
`keep_outputs` allocates 1 MiB that is never freed (the leak: 25 MiB at the end). Each step
ends with memsnap.step() when the memsnap package imports, else the C memsnap_step when the
library is preloaded, else nothing. Nothing is freed before exit.

Prints result steps=, leak_bytes_per_step=, expected_leak_bytes=, allocated_bytes=,
reserved_bytes=, attach_calls=, steps_marked=, then the fake driver's truth lines.
"""

import ctypes
import os
import sys

STEPS = 25
LEAK = 1 << 20
TEMP = 4 << 20

HERE = os.path.dirname(os.path.abspath(__file__))
STANDIN_DIR = os.environ.get("STANDIN_DIR") or os.path.join(HERE, "..")

# The runtime joins the global scope, as PyTorch's CUDA dependencies do (torch/__init__.py
# loads them through libtorch_global_deps.so with RTLD_GLOBAL). argv[1] == "local" loads it
# RTLD_LOCAL instead: then the stand-in's cudaMalloc, bound to a preloaded library's export,
# has no global "next" definition, and memsnap must find the runtime by its soname.
CUDART_MODE = ctypes.RTLD_LOCAL if sys.argv[1:2] == ["local"] else ctypes.RTLD_GLOBAL
CUDART = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13", mode=CUDART_MODE)
CUDART.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
CUDART.cudaMalloc.restype = ctypes.c_int
CUDART.cudaFree.argtypes = [ctypes.c_void_p]
CUDART.cudaFree.restype = ctypes.c_int

try:
    import memsnap
except ImportError:
    memsnap = None


def mark_step():
    if memsnap is not None:
        return memsnap.step()
    step = getattr(ctypes.CDLL(None), "memsnap_step", None)
    return step is not None and step() == 0


def load_standin():
    lib = ctypes.CDLL(os.path.join(STANDIN_DIR, "torch", "lib", "libc10_cuda.so"))
    lib.standin_init.argtypes = [ctypes.c_int]
    lib.standin_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t]
    lib.standin_malloc.restype = ctypes.c_void_p
    lib.standin_free.argtypes = [ctypes.c_void_p]
    for name in ("standin_allocated_bytes", "standin_reserved_bytes"):
        getattr(lib, name).argtypes = [ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_ulonglong
    lib.standin_attach_calls.restype = ctypes.c_ulonglong
    return lib


def allocate(lib, nbytes):
    ptr = lib.standin_malloc(nbytes, 0, 0)
    if not ptr:
        raise RuntimeError(f"standin_malloc({nbytes}) failed")
    return ptr


def keep_outputs(lib, kept):
    kept.append(allocate(lib, LEAK))


def forward(lib):
    hidden = allocate(lib, TEMP)
    lib.standin_free(hidden)


def train(lib, kept):
    marked = 0
    for _ in range(STEPS):
        forward(lib)
        keep_outputs(lib, kept)
        marked += bool(mark_step())
    return marked


def main():
    first = ctypes.c_void_p()
    if CUDART.cudaMalloc(ctypes.byref(first), 4096) != 0:
        sys.exit("cudaMalloc failed")
    CUDART.cudaFree(first)
    lib = load_standin()
    lib.standin_init(2)
    kept = []
    marked = train(lib, kept)
    print(f"result steps={STEPS}")
    print(f"result leak_bytes_per_step={LEAK}")
    print(f"result expected_leak_bytes={STEPS * LEAK}")
    print(f"result allocated_bytes={lib.standin_allocated_bytes(0)}")
    print(f"result reserved_bytes={lib.standin_reserved_bytes(0)}")
    print(f"result attach_calls={lib.standin_attach_calls()}")
    print(f"result steps_marked={marked}")
    sys.stdout.flush()
    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.fake_cuda_print_truth_fd(1)


if __name__ == "__main__":
    main()
