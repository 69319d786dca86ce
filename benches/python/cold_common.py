"""What benches/python/cold_capture.py and cold_hook.py share: their Python caller's depth, their
arguments, the C helper each compiles and how a figure's rounds are shown."""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def python_deep(n, call):
    """call() from n Python frames deep."""
    if n <= 1:
        return call()
    return python_deep(n - 1, call)


def arguments(doc, evict, stacks, between):
    """The command line both take: libraries, rounds, KiB written between two timed calls
    (`between` names them), stacks settings, iterations."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("libs", nargs="+")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--evict", default=evict, help=f"KiB written between two {between}")
    ap.add_argument("--stacks", default=stacks)
    ap.add_argument("--iterations", type=int, default=3000)
    return ap.parse_args()


def compile_helper(name, source):
    """(folder, shared library) built from C `source` in a fresh temporary folder; exits with a
    message naming `name` when there is no C compiler."""
    if shutil.which("cc") is None:
        sys.exit(f"{name}: needs a C compiler (cc) for its caller")
    tmp = tempfile.mkdtemp(prefix=f"memsnap-{name}-")
    src, lib = os.path.join(tmp, "helper.c"), os.path.join(tmp, "libhelper.so")
    with open(src, "w") as f:
        f.write(source)
    subprocess.run(["cc", "-O2", "-fPIC", "-shared", "-o", lib, src], check=True)
    return tmp, lib


def median_range(values):
    """A figure's rounds as "median (lowest..highest)", in ns to a tenth."""
    v = sorted(values)
    return f"{statistics.median(v):.1f} ({v[0]:.1f}..{v[-1]:.1f})"
