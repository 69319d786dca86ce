#!/usr/bin/env python3
"""Checks that memsnap's route into PyTorch's caching allocator fits a PyTorch release, from its
wheel alone (no GPU): the symbols memsnap looks up and the trace-entry layout it reads.

    pip download torch==2.12.1 --no-deps -d /tmp/whl
    python3 scripts/check-torch-release.py /tmp/whl/torch-2.12.1-*.whl [more wheels or unpacked torch/ folders]

For each release it prints one line: the version, whether libc10_cuda.so keeps a symbol table
with NativeCachingAllocator's virtual table, initialized() and attachAllocatorTraceTracker(), and
exports CUDACachingAllocator::allocator; where attachAllocatorTraceTracker sits in the virtual
table (read from the relocations; memsnap finds it at run time, this is for the record); and
whether TraceEntry's members up to time_ are in one of the orders memsnap reads
(src/pytorch/layout.rs): action_, device_, addr_, context_ (a shared_ptr), stream_, size_,
then mempool_ (a MempoolId_t: two 64-bit ids) and time_ (2.8 to 2.15: time_ at byte 64), or
time_ at once (2.4 to 2.7: at byte 48), printed as "layout 2.8" or "layout 2.4" (a release
whose order is not the one memsnap picks for its version does not fit); and whether
record_trace reads the time-stamp counter (rdtsc) for time_, which memsnap then takes as the entry's time.
Exits 1 if any release does not fit. Needs binutils (nm, readelf). docs/PYTORCH.md,
"Adding a PyTorch release", says what to do with a release that does not fit.
"""
import os
import re
import subprocess
import sys
import tempfile
import zipfile

NATIVE = "N3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator"
SYMBOLS = {
    "vtable": f"_ZTV{NATIVE}E",
    "initialized": f"_Z{NATIVE}11initializedEv",
    "attach": f"_Z{NATIVE}27attachAllocatorTraceTracker",
}
ALLOCATOR = "_ZN3c104cuda20CUDACachingAllocator9allocatorE"
# The member orders memsnap knows, each named by its first release, with the releases
# memsnap reads with it (src/pytorch/layout.rs, KNOWN).
LAYOUTS = {
    "2.8": ["action_", "device_", "addr_", "context_", "stream_", "size_", "mempool_", "time_"],
    "2.4": ["action_", "device_", "addr_", "context_", "stream_", "size_", "time_"],
}
RELEASES = {"2.8": ((2, 8), (2, 15)), "2.4": ((2, 4), (2, 7))}
HEADERS = ["c10/core/CachingDeviceAllocator.h", "c10/cuda/CUDACachingAllocator.h"]


def unpack(path, work):
    """The torch/ folder of a wheel (only the files this check reads) or of an unpacked one."""
    if os.path.isdir(path):
        return path
    wanted = ["torch/lib/libc10_cuda.so", "torch/version.py"] + [f"torch/include/{h}" for h in HEADERS]
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        for name in wanted:
            if name in names:
                z.extract(name, work)
    return os.path.join(work, "torch")


def symbols(lib, dynamic=False):
    out = subprocess.run(["nm"] + (["-D"] if dynamic else []) + [lib], capture_output=True, text=True).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:
            table[parts[2]] = int(parts[0], 16)
    return table


def vtable_slot(lib, table):
    """The attach method's entry in NativeCachingAllocator's virtual table, from the
    R_X86_64_RELATIVE relocations that fill the table at load time."""
    vt = table.get(SYMBOLS["vtable"])
    attach = next((a for n, a in table.items() if n.startswith(SYMBOLS["attach"])), None)
    if vt is None or attach is None:
        return None
    relocs = subprocess.run(["readelf", "-rW", lib], capture_output=True, text=True).stdout
    for line in relocs.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "R_X86_64_RELATIVE":
            offset, addend = int(parts[0], 16), int(parts[3], 16)
            if addend == attach and offset >= vt + 16:
                return (offset - vt - 16) // 8
    return None


def members(torch_dir):
    """TraceEntry's data members in order, from the release's own header."""
    for header in HEADERS:
        path = os.path.join(torch_dir, "include", header)
        if not os.path.exists(path):
            continue
        text = open(path, encoding="utf-8").read()
        m = re.search(r"struct TraceEntry \{(.*?)\n\};", text, re.S)
        if not m:
            continue
        body = re.sub(r"//[^\n]*", "", m.group(1))
        body = re.sub(r"enum Action \{.*?\};", "", body, flags=re.S)
        body = re.sub(r"TraceEntry\(.*?\{.*?\}", "", body, flags=re.S)  # the constructor
        return re.findall(r"\b(\w+_)\s*(?:\{\}|\{[^}]*\})?;", body)
    return None


def record_trace_reads_counter(lib):
    """Whether DeviceCachingAllocator::record_trace executes rdtsc (PyTorch's approximate clock
    on x86-64, the value it stores in TraceEntry::time_)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", lib], capture_output=True, text=True).stdout
    function = ""
    for line in out.splitlines():
        if line.endswith(">:"):
            function = line
        elif "\trdtsc" in line and "DeviceCachingAllocator::record_trace(" in function:
            return True
    return False


def version(torch_dir):
    try:
        text = open(os.path.join(torch_dir, "version.py"), encoding="utf-8").read()
    except OSError:
        return "?"
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
    return m.group(1) if m else "?"


def major_minor(text):
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def describe(order, layout, picked):
    """Why the layout does not fit."""
    if layout is None:
        return f"DIFFERS: {order}"
    if picked is None:
        return f"{layout}, but memsnap picks no layout for this release (src/pytorch/layout.rs)"
    return f"DIFFERS: {layout}'s order, where memsnap reads this release with {picked}'s"


def check(path):
    with tempfile.TemporaryDirectory() as work:
        torch_dir = unpack(path, work)
        lib = os.path.join(torch_dir, "lib", "libc10_cuda.so")
        if not os.path.exists(lib):
            return False, f"{path}: no torch/lib/libc10_cuda.so"
        table = symbols(lib)
        found = {k: any(n.startswith(s) for n in table) for k, s in SYMBOLS.items()}
        exported = ALLOCATOR in symbols(lib, dynamic=True)
        slot = vtable_slot(lib, table)
        order = members(torch_dir)
        layout = next((name for name, members in LAYOUTS.items()
                       if order is not None and order[: len(members)] == members), None)
        release = major_minor(version(torch_dir))
        picked = next((name for name, (low, high) in RELEASES.items()
                       if release is not None and low <= release <= high), None)
        layout_ok = layout is not None and layout == picked
        counter = record_trace_reads_counter(lib)
        ok = all(found.values()) and exported and layout_ok and counter
        missing = [k for k, v in found.items() if not v] + ([] if exported else ["allocator export"])
        line = (f"{version(torch_dir):<16} symbols {'ok' if not missing else 'MISSING ' + ','.join(missing)}"
                f"  attach entry {slot if slot is not None else '?'}"
                f"  layout {layout if layout_ok else describe(order, layout, picked)}"
                f"  time {'rdtsc' if counter else 'NOT the time-stamp counter'}")
        return ok, line


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip().splitlines()[0])
        print("usage: check-torch-release.py WHEEL_OR_TORCH_DIR...")
        return 2
    for tool in ("nm", "readelf", "objdump"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            print(f"check-torch-release: {tool} is needed (binutils)")
            return 2
    bad = 0
    for path in sys.argv[1:]:
        ok, line = check(path)
        print(("fits   " if ok else "DIFFERS ") + line)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
