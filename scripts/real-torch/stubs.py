"""Stand-ins for the NVIDIA libraries a PyTorch wheel links, so that the real PyTorch runs on
memsnap's simulated CUDA driver without a GPU (scripts/real-torch/setup.sh).

    python3 stubs.py SITE SIMULATED_DEFINED OUTDIR

SITE is the folder the wheel was unpacked into (SITE/torch/lib/*.so). For every library those
objects name as needed that neither the wheel nor the system provides (cuBLAS, cuDNN, NCCL,
...), writes OUTDIR/<soname>.c defining each symbol the wheel imports from it, and
OUTDIR/<soname>.map, the version script that gives them the version the wheel asks for
(`cublasCreate_v2@libcublas.so.13`: without the version node the loader refuses the wheel).
Nothing in most of them is called by a program that only allocates tensors and runs
elementwise operations; such a function returns 999 (no library's success code) and, with
REAL_TORCH_TRACE_STUBS set, names itself on stderr. cuBLAS and cuBLASLt are the exception:
their functions return success (0) and compute nothing, so that a model's matrix products run
their allocations as on a GPU (`nn.Linear`: the workspace, the output; cuBLASLt's algorithm
heuristic is scripts/real-torch/cublaslt.c's, which offers one algorithm).

The CUDA runtime (libcudart.so.13, or .12 for a wheel built for CUDA 12) is another exception:
the simulated runtime (tests/fake_cuda/fake_cudart.c) and scripts/real-torch/runtime.c
implement what PyTorch's allocator, its initialization and its kernel launches call, and the
generated file covers the rest of what the wheel imports, returning cudaSuccess (0) without
writing any out-parameter. libcuda.so.1 is the simulated driver itself (not generated).
SIMULATED_DEFINED lists the symbols the simulated driver and runtime and the cuBLASLt
stand-in define: none of them is generated again.

Symbols the wheel imports without a version and nothing loaded defines (NCCL's, cuFile's,
cuSPARSELt's, a few of the driver's) go into the NCCL stand-in: the loader looks them up in
every object loaded, so one place is enough.
"""
import collections
import os
import re
import subprocess
import sys

SYSTEM_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")
OWN = ("libcuda.so.1",)  # the simulated driver, built from tests/fake_cuda


def run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def system_path(soname):
    for d in SYSTEM_DIRS:
        if os.path.exists(os.path.join(d, soname)):
            return os.path.join(d, soname)
    return None


def wheel_objects(site):
    lib = os.path.join(site, "torch", "lib")
    objects = [os.path.join(lib, f) for f in sorted(os.listdir(lib)) if ".so" in f]
    top = os.path.join(site, "torch")
    objects += [os.path.join(top, f) for f in sorted(os.listdir(top)) if f.startswith("_C") and f.endswith(".so")]
    return [o for o in objects if os.path.isfile(o)]


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__.split("\n\n")[1])
    site, simulated_defined, out = sys.argv[1:]
    objects = wheel_objects(site)
    if not objects:
        sys.exit(f"real-torch/stubs.py: no torch/lib/*.so under {site}")
    present = set(os.listdir(os.path.join(site, "torch", "lib")))
    needed, version_file = set(), {}
    imports = collections.defaultdict(dict)  # name -> {version or None: symbol type}
    for obj in objects:
        needed.update(re.findall(r"NEEDED.*\[(.*)\]", run("readelf", "-d", "-W", obj)))
        current = None
        for line in run("readelf", "-V", "-W", obj).splitlines():
            m = re.search(r"File: (\S+)", line)
            if m:
                current = m.group(1)
                continue
            m = re.search(r"Name: (\S+)", line)
            if m and current:
                version_file[m.group(1)] = current
        for line in run("readelf", "--dyn-syms", "-W", obj).splitlines():
            p = line.split()
            if len(p) >= 8 and p[6] == "UND":
                name, _, version = p[7].partition("@")
                imports[name][version.split(" ")[0] or None] = p[3]
    missing = sorted(n for n in needed if n not in present and system_path(n) is None)
    defined = set()
    for obj in objects + [system_path(n) for n in needed if system_path(n)]:
        for line in run("nm", "-D", "--defined-only", obj).splitlines():
            p = line.split()
            if len(p) >= 3:
                defined.add(p[2].split("@")[0])
    with open(simulated_defined) as f:
        simulated = {line.strip() for line in f if line.strip()}
    by_library = collections.defaultdict(dict)
    unversioned = {}
    for name, versions in imports.items():
        for version, kind in versions.items():
            if version and version_file.get(version) in missing:
                by_library[version_file[version]][name] = (version, kind)
            elif version is None and name not in defined and name not in simulated \
                    and not name.startswith(("_", "Py")):
                # (Python's own symbols come from the interpreter; names beginning with _
                # are the toolchain's weak hooks.)
                unversioned[name] = kind
    os.makedirs(out, exist_ok=True)
    for soname in missing:
        if soname in OWN:
            continue
        symbols = dict(by_library.get(soname, {}))
        if soname == "libnccl.so.2":
            for name, kind in unversioned.items():
                symbols.setdefault(name, (None, kind))
        runtime = soname.startswith("libcudart.so.")
        # (What the simulated runtime and the cuBLASLt stand-in define is linked in instead.)
        symbols = {n: v for n, v in symbols.items() if n not in simulated}
        versions = sorted({v for v, _ in symbols.values() if v}) or [soname]
        succeeds = runtime or soname.startswith(("libcublas.so.", "libcublasLt.so."))
        result = "0" if succeeds else "999"
        with open(os.path.join(out, soname + ".c"), "w") as c:
            c.write("/* Generated by scripts/real-torch/stubs.py: what the wheel imports from "
                    f"{soname}. */\n#include <stdio.h>\n#include <stdlib.h>\n")
            c.write("static void named(const char *name) {\n"
                    "    if (getenv(\"REAL_TORCH_TRACE_STUBS\")) fprintf(stderr, \"stub called: %s\\n\", name);\n}\n")
            for name, (_, kind) in sorted(symbols.items()):
                if kind == "OBJECT":
                    c.write(f"char {name}[4096];\n")
                else:
                    c.write(f"long {name}(void) {{ named(\"{name}\"); return {result}; }}\n")
        with open(os.path.join(out, soname + ".map"), "w") as m:
            # Each symbol under the version the wheel asks for it with; the rest (the
            # runtime's own functions, the unversioned) under the first.
            for i, v in enumerate(versions):
                names = sorted(n for n, (version, _) in symbols.items() if version == v)
                listed = " ".join(f"{n};" for n in names)
                m.write(f"{v} {{ global: {listed}{' *;' if i == 0 else ''} }};\n")
        print(f"{soname}: {len(symbols)} symbols, version {', '.join(versions)}")


if __name__ == "__main__":
    main()
