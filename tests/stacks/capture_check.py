"""Run by tests/stacks_python.rs under each installed CPython: checks the Python frames
memsnap captures without the GIL (ctypes releases it around the call, as PyTorch's CUDA
calls do). Usage: python3 capture_check.py path/to/libmemsnap.so"""
import ctypes
import gc
import json
import sys
import threading

NONE, PYTHON, NATIVE, ALL = 0, 1, 2, 3
lib = ctypes.CDLL(sys.argv[1])
fn = lib.memsnap_debug_capture_json
fn.restype = ctypes.c_ssize_t
fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
SRC = open(__file__).read().splitlines()
checks = 0


def line(marker):
    hits = [i + 1 for i, l in enumerate(SRC) if l.rstrip().endswith("# " + marker)]
    assert len(hits) == 1, marker
    return hits[0]


def capture(mode, max_frames=0):
    buf = ctypes.create_string_buffer(1 << 20)
    n = fn(mode, max_frames, buf, len(buf))  # CAPTURE
    assert 0 < n <= len(buf), n
    return json.loads(buf.raw[:n])


def check(cond, what):
    global checks
    if not cond:
        print("FAIL:", what, file=sys.stderr)
        sys.exit(1)
    checks += 1


def py_only(frames):
    return [(f["name"], f["line"]) for f in frames if f["filename"] == __file__]


def inner(mode):
    return capture(mode)  # INNER


def middle(mode):
    return inner(mode)  # MIDDLE


def outer(mode):
    return middle(mode)  # OUTER


EXPECTED = [
    ("capture", line("CAPTURE")),
    ("inner", line("INNER")),
    ("middle", line("MIDDLE")),
    ("outer", line("OUTER")),
]

# 1. Python frames only: exactly our functions, innermost first, exact lines.
r = outer(PYTHON)  # MODULE_PY
frames = r["frames"]
check(
    [(f["name"], f["line"]) for f in frames] == EXPECTED + [("<module>", line("MODULE_PY"))],
    f"python-only frames {frames}",
)
check(all(f["filename"] == __file__ for f in frames), f"filenames {frames}")
check(not r["truncated"], "not truncated")

# Placement among native frames needs the interpreter's eval loop by name: a stripped
# interpreter (a distribution's binary without its debug symbols) has none, and its Python
# frames follow the native ones. Such a run says so in its OK line instead of passing
# these checks silently.
EVAL_NAMED = any("PyEval_EvalFrame" in f["name"] for f in outer(NATIVE)["frames"])

# 2. All: the same Python frames, placed before the interpreter frame that ran them, among
#    native frames; none of memsnap's own frames.
r = outer(ALL)  # MODULE_ALL
frames = r["frames"]
check(py_only(frames) == EXPECTED + [("<module>", line("MODULE_ALL"))], f"all: {frames}")
names = [f["name"] for f in frames]
check(any("_ctypes_callproc" in n or "ffi_call" in n for n in names), f"ctypes frames: {names}")
check(all("memsnap" not in n for n in names), f"own frames leaked: {names}")
last_py = max(i for i, f in enumerate(frames) if f["filename"] == __file__)
if EVAL_NAMED:
    check("PyEval_EvalFrame" in frames[last_py + 1]["name"], f"placement: {names}")
first_py = min(i for i, f in enumerate(frames) if f["filename"] == __file__)
check(first_py > 0 and all(f["filename"] != __file__ for f in frames[:first_py]), "natives first")

# 3. Native only: no Python frames.
r = outer(NATIVE)
check(py_only(r["frames"]) == [], "native-only has no Python frames")
check(len(r["frames"]) >= 5, f"native-only frames {r['frames']}")


# 4. Deep recursion past max_frames.
def deep(n, mode, max_frames):
    if n == 0:
        return capture(mode, max_frames)
    return deep(n - 1, mode, max_frames)  # DEEP


r = deep(100, PYTHON, 16)
check(r["truncated"], "deep recursion truncated")
check(len(r["frames"]) == 16, f"16 frames, got {len(r['frames'])}")
check(r["frames"][0]["name"] == "capture", "innermost first")
check(all(f == ("deep", line("DEEP")) for f in py_only(r["frames"])[2:]), "deep lines")


# 5. Non-ASCII function names (latin-1 and UCS-2 compact strings).
def größe():
    return capture(PYTHON)  # LATIN1


def 名前():
    return größe()  # UCS2


r = 名前()
check(py_only(r["frames"])[1:3] == [("größe", line("LATIN1")), ("名前", line("UCS2"))],
      f"unicode names {r['frames']}")

# 6. Python -> C (map) -> Python: two eval calls; each group of Python frames sits just
#    before the interpreter frame that ran it, with native frames between the groups.
def via_map_leaf(_):
    return capture(ALL)  # MAP_LEAF


def via_map():
    return list(map(via_map_leaf, [0]))[0]  # MAP_CALL


r = via_map()
frames = r["frames"]
check(py_only(frames)[:3] == [("capture", line("CAPTURE")), ("via_map_leaf", line("MAP_LEAF")),
                              ("via_map", line("MAP_CALL"))], f"map frames {frames}")
runs, i = [], 0
while i < len(frames):
    if frames[i]["filename"] == __file__:
        j = i
        while j < len(frames) and frames[j]["filename"] == __file__:
            j += 1
        runs.append((i, j))
        i = j
    else:
        i += 1
if EVAL_NAMED:
    check(len(runs) >= 2, f"two groups: {[f['name'] for f in frames]}")
    for _, end in runs:
        check(end < len(frames) and "PyEval_EvalFrame" in frames[end]["name"],
              f"group followed by the eval frame: {[f['name'] for f in frames]}")
    # 3.11+ runs Python-to-Python calls in one eval call; 3.10 runs each frame in its own.
    inner = ["capture", "via_map_leaf"] if sys.version_info >= (3, 11) else ["capture"]
    check([f["name"] for f in frames[runs[0][0]:runs[0][1]]] == inner,
          f"inner group {[f['name'] for f in frames]}")

# 7. Generators: a generator frame sits in the chain like any other.
def gen():
    yield capture(PYTHON)  # GEN_YIELD


def use_gen():
    return next(gen())  # GEN_NEXT


r = use_gen()
check(py_only(r["frames"])[:3] == [("capture", line("CAPTURE")), ("gen", line("GEN_YIELD")),
                                   ("use_gen", line("GEN_NEXT"))], f"generator {r['frames']}")

# 8. Code objects freed and re-created (likely at the same address, same first line):
#    each capture names the function that really ran.
for i in range(30):
    ns = {}
    exec(compile(f"def made_{i}(cap):\n    return cap()\n", f"<made {i % 3}>", "exec"), ns)
    r = ns[f"made_{i}"](lambda: capture(PYTHON))
    got = [(f["name"], f["filename"], f["line"]) for f in r["frames"][:3]]
    check(got[2] == (f"made_{i}", f"<made {i % 3}>", 2), f"recycled code {i}: {got}")
    del ns
    gc.collect()  # free the code object so the next one can reuse its address

# 9. Threads: each thread sees its own Python frames.
results = {}


def worker(k):
    def leaf():
        return capture(PYTHON)  # THREAD_LEAF

    for _ in range(50):
        results.setdefault(k, []).append(leaf())  # THREAD_CALL


threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
for k, rs in results.items():
    for r in rs:
        got = py_only(r["frames"])
        check(got[:3] == [("capture", line("CAPTURE")), ("leaf", line("THREAD_LEAF")),
                          ("worker", line("THREAD_CALL"))], f"thread {k}: {got}")
        check(not any(name == "<module>" for name, _ in got), "no main-thread frames")
check(len(results) == 4, "4 threads")

note = "" if EVAL_NAMED else (
    "; placement among native frames NOT checked (no native frame is named "
    "PyEval_EvalFrame: a stripped interpreter)")
print(f"OK {checks} checks, Python {sys.version_info[0]}.{sys.version_info[1]}{note}")
