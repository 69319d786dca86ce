"""Run by tests/stacks_python.rs under a CPython memsnap has no layout for (3.9): Python
frames are off with one warning, native frames still work.
Usage: python3 unsupported_check.py path/to/libmemsnap.so"""
import ctypes
import json
import sys

lib = ctypes.CDLL(sys.argv[1])
fn = lib.memsnap_debug_capture_json
fn.restype = ctypes.c_ssize_t
fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]


def capture(mode):
    buf = ctypes.create_string_buffer(1 << 20)
    n = fn(mode, 0, buf, len(buf))
    return json.loads(buf.raw[:n])


first = capture(3)
second = capture(1)
version = f"{sys.version_info[0]}.{sys.version_info[1]}"
ok = (
    len(first["warnings"]) == 1
    and f"Python {version} is not supported" in first["warnings"][0]
    and second["warnings"] == []
    and second["frames"] == []
    and all(f["filename"] != __file__ for f in first["frames"])
    and any("_PyEval_EvalFrameDefault" in f["name"] for f in first["frames"])
)
print(first["warnings"], len(first["frames"]), "native frames")
print("OK" if ok else "FAIL")
sys.exit(0 if ok else 1)
