"""py_frames_kept.py: allocations whose Python code is freed, or whose library is unloaded, right
after them (tests/frames_kept.rs). Allocates through libcudart.so.13 with ctypes, which releases
the GIL around each call, as PyTorch does.

Modes (argv[1]):
  generated N   N times: compiles a module `generated_<i>.py` whose function `gen_alloc`
                allocates, calls it once and drops it (its code object is freed), then
                every other time compiles fillers; the next compiles take the freed
                memory. The first of these is the process's first allocation. Then exits
                at once.
  exit MS       three allocations, from module level and from functions one and three calls
                deep, then exits MS milliseconds later (the script's code is freed at exit)
  signal MS     the same, then sends itself the dump signal (SIGUSR1) MS milliseconds later
                and exits at once
  long S [function]  runs a module `long_<S>.py` compiled for it (its code object freed as it
                ends): S module-level statements, then a line of 150 names, then its last line
                (S + 2) allocates; with `function`, it calls `long_body` (lines 1-604) there
                instead, which allocates from line 603: 300 statements, a line of 150 names, 300
                blank lines, then a call over two lines past column 127. Long code objects, over
                256 names and constants (EXTENDED_ARG), lines past 255 and line tables' long
                entries. Then exits at once
  unload LIB HOW  allocates through LIB (tests/programs/kept_lib.c built as a library), then
                `keep`s it loaded, `close`s it with dlclose at once, or closes it and
                `delete`s its file; exits at once

For each allocation, prints `truth size=S stack=JSON` just before it: Python's own view of the
stack at the call, innermost first, as [file, function, line].
"""

import ctypes
import json
import os
import signal
import sys
import time

CUDART = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
CUDART.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
CUDART.cudaMalloc.restype = ctypes.c_int


def python_stack(frame, line):
    """The stack from `frame` outwards, innermost first; `line` for `frame` itself."""
    out = [[frame.f_code.co_filename, frame.f_code.co_name, line]]
    frame = frame.f_back
    while frame is not None:
        out.append([frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno])
        frame = frame.f_back
    return out


def alloc(size, quiet=False):
    """Allocates `size` bytes; prints Python's stack at the call first, unless `quiet`."""
    ptr = ctypes.c_void_p()
    if not quiet:
        here = sys._getframe()
        truth(size, python_stack(here, here.f_lineno + 1))
    err = CUDART.cudaMalloc(ctypes.byref(ptr), size)
    if err != 0:
        raise RuntimeError(f"cudaMalloc({size}) failed: {err}")
    return ptr.value


def truth(size, stack):
    """Printed before the allocation: nothing runs between it and what follows."""
    global LAST
    LAST = stack
    print(f"truth size={size} stack={json.dumps(stack)}")


LAST = None


GENERATED = "def gen_alloc(size):\n    n = size\n    return alloc(n, QUIET)\n"
FILLER = "def filler_{0}(a, b):\n    c = a + b * {0}\n    return [c, a, b, {0}]\n"


def run_generated(count):
    """A probe module first, whose allocation prints Python's stack; then `count` modules
    that allocate quietly along the same path: their stacks are the probe's with their own
    file, printed at the end. Between two of them nothing but the loop runs, so that what one
    frees the next compile takes."""
    for i in range(-1, count):
        scope = {"alloc": alloc, "QUIET": i >= 0}
        exec(compile(GENERATED, f"generated_{i}.py", "exec"), scope)
        scope["gen_alloc"](4096 * (i + 2))
        scope.clear()  # gen_alloc and its code object are freed here
        # Every other time fillers take the memory first; else the next module does (on
        # 3.10/3.11 its code object and names then look the same but for the file).
        for j in range(4 * (i % 2)):
            exec(compile(FILLER.format(j), "filler.py", "exec"), {})
    return LAST


def print_generated(probe, count):
    """The quiet modules' stacks: the probe's, with their own file."""
    for i in range(count):
        stack = [list(frame) for frame in probe]
        stack[1][0] = f"generated_{i}.py"
        print(f"truth size={4096 * (i + 2)} stack={json.dumps(stack)}")


def long_source(statements, function):
    """The source `long S [function]` runs (see above)."""
    lines = []
    if function:
        lines.append("def long_body(size):")
        lines += [f"    t{i} = {i}" for i in range(300)]
        lines.append("    t = [" + ", ".join(f"t{i}" for i in range(150)) + "]")
        lines += [""] * 300
        lines.append("    return [" + ", ".join(f"t{i}" for i in range(32)) + ", alloc(")
        lines.append("        size)]")
    lines += [f"v{i} = {i}" for i in range(statements)]
    lines.append("w = [" + ", ".join(f"v{i}" for i in range(min(statements, 150))) + "]")
    lines.append(f"x = {'long_body' if function else 'alloc'}({5000 + statements})")
    return "\n".join(lines) + "\n"


def run_long(statements, function):
    scope = {"alloc": alloc}
    # The module's code object is freed as exec returns, long_body's as `scope` is cleared.
    exec(compile(long_source(statements, function), f"long_{statements}.py", "exec"), scope)
    scope.clear()


def deep3(size):
    return alloc(size)


def deep2(size):
    return deep3(size)


def deep1(size):
    return deep2(size)


def run_unload(path, how):
    import _ctypes

    # Global, as PyTorch loads its CUDA libraries: memsnap's cudaMalloc, which the library's
    # call reaches, forwards to the runtime in the global scope.
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    lib.kept_alloc.argtypes = [ctypes.c_size_t]
    lib.kept_alloc.restype = ctypes.c_void_p
    here = sys._getframe()
    truth(1 << 20, python_stack(here, here.f_lineno + 1))
    if not lib.kept_alloc(1 << 20):
        raise RuntimeError("kept_alloc failed")
    if how in ("close", "delete"):
        _ctypes.dlclose(lib._handle)
    if how == "delete":
        os.unlink(path)


MODE = sys.argv[1]
if MODE == "generated":
    COUNT = int(sys.argv[2])
    print_generated(run_generated(COUNT), COUNT)
elif MODE in ("exit", "signal"):
    alloc(1000)
    deep1(3000)
    deep3(2000)
    time.sleep(int(sys.argv[2]) / 1000)
    if MODE == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
elif MODE == "long":
    run_long(int(sys.argv[2]), sys.argv[3:] == ["function"])
elif MODE == "unload":
    run_unload(sys.argv[2], sys.argv[3])
else:
    sys.exit(f"unknown mode {MODE}")
