"""Per-event cost inside real PyTorch, without GPU work to hide it, in a training-loop-like
pattern: each iteration drops the oldest of 16 live tensors and allocates a new one, with a
size from a fixed set of 256 (512 B .. 1 MiB, deterministic pseudo-random order), from one of
6 call sites in rotation, 12 Python frames deep at torch.empty.

- memsnap rows (not loaded / MEMSNAP_STACKS none, python, all) run under
  PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: every tensor is one cudaMallocAsync and
  one cudaFreeAsync, two memsnap events per iteration.
- PyTorch's own recorder (torch.cuda.memory._record_memory_history(stacks=python|all), its
  default context="all") runs with the default caching allocator, the only one it records:
  two trace entries per iteration (alloc, free), none of them a CUDA call once cached.
  Its baseline is the default allocator without the recorder.

Every configuration runs in its own process; rounds alternate all of them (order reversed
every other round), and each figure is the best over all its runs (each run: best of 5 timed
loops). Every memsnap run writes its exit snapshot into a folder of its own, and the table
reports what the snapshot says was recorded, dropped and left without a stack (read with
benches/python/snapshot_counts.py); a configuration that lost anything in any run, or whose
snapshot accounts for fewer events than the loop made, prints VOID instead of a figure.
Recorder runs check that the recorder kept trace entries with frames.

Because the timings between processes are bimodal on shared virtual machines, every memsnap run
also times the same loop with its thread's calls passing through memsnap unrecorded
(memsnap_debug_pass_through, alternating with the recorded loop; it exists only in a library
built with the bench-hooks feature, which the shipped library and the wheel leave off:
`cargo build --release --lib --features bench-hooks --target-dir target/gpu` gives
target/gpu/release/libmemsnap.so; without it, as in older builds, that comparison is skipped), and
the report gives per-event differences within each process (median and range over runs). Where
the kernel exposes the loop thread's instruction counter (perf_event_open), instructions per
iteration are reported as well.

    python3 benches/gpu/hook_cost_torch.py --lib target/release/libmemsnap.so
        [--rounds 3] [--iterations 20000] [--memsnap-context alloc|all] [--json FILE]
        [--also-lib before=OLD/libmemsnap.so]   (another build's MEMSNAP_STACKS=all row, same rounds)
    python3 benches/gpu/hook_cost_torch.py drive LIBMEMSNAP     (older spelling of --lib)
    python3 benches/gpu/hook_cost_torch.py                      (one measurement, this process's
                                                                 environment; prints JSON)
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# This folder, the benchmarks' Python helpers (benches/python) and the helpers the GPU
# checks share with the benchmarks (scripts/gpu).
sys.path[:0] = [HERE, os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "..", "scripts", "gpu")]
from snapshot_counts import Tally, read_counts  # noqa: E402

ASYNC = "backend:cudaMallocAsync"
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "PYTHONUNBUFFERED": "1"}
RECORDER_MAX_ENTRIES = 100000  # memsnap's default MEMSNAP_MAX_ENTRIES too
CONFIGS = [
    # name, PYTORCH_CUDA_ALLOC_CONF, memsnap stacks (None = not loaded), recorder stacks, baseline
    ("async/no-preload", ASYNC, None, None, None),
    ("async/memsnap-none", ASYNC, "none", None, "async/no-preload"),
    ("async/memsnap-python", ASYNC, "python", None, "async/no-preload"),
    ("async/memsnap-all", ASYNC, "all", None, "async/no-preload"),
    ("default/no-recorder", "", None, None, None),
    ("default/torch-python", "", None, "python", "default/no-recorder"),
    ("default/torch-all", "", None, "all", "default/no-recorder"),
]
RATIOS = [("python", "default/torch-python", "async/memsnap-python"),
          ("all", "default/torch-all", "async/memsnap-all")]
# Rows added by --also-lib NAME=PATH: another build of the library, MEMSNAP_STACKS=all, timed in
# the same rounds as the rest (config name -> library path).
OTHER_LIBS = {}

# ----------------------------------------------------------------------------------------------
# One measurement (child process)

N_SIZES, SITES, WINDOW, PY_FRAMES = 256, 6, 16, 12
# 512 B .. 1 MiB: larger blocks make the async pool map and unmap device memory, whose cost
# varies by thousands of ns per iteration from one process to the next and hides the hooks.
SIZES = [(int(512 * 1.03027**i) + 511) // 512 * 512 for i in range(N_SIZES)]


def size_sequence(n=1 << 16, seed=20261122):
    import random

    rng = random.Random(seed)
    return [SIZES[rng.randrange(N_SIZES)] for _ in range(n)]


class Loop:
    """The window of live tensors and the call sites. make(size) allocates one tensor."""

    def __init__(self, make):
        self.make = make
        self.live = [None] * WINDOW
        self.head = 0
        self.events = 0  # allocations + frees the loop made

    def step(self, size):
        h = self.head
        if self.live[h] is not None:
            self.live[h] = None  # frees the oldest (refcount drops to zero here)
            self.events += 1
        self.live[h] = self.make(size)
        self.events += 1
        self.head = (h + 1) % WINDOW

    def drain(self):
        for h in range(WINDOW):
            if self.live[h] is not None:
                self.live[h] = None
                self.events += 1

    # Distinct call sites: six methods, each its own frame (and line) on the Python stack.
    def site0(self, size):
        self.step(size)

    def site1(self, size):
        self.step(size)

    def site2(self, size):
        self.step(size)

    def site3(self, size):
        self.step(size)

    def site4(self, size):
        self.step(size)

    def site5(self, size):
        self.step(size)


def python_depth():
    f, n = sys._getframe(1), 0
    while f is not None:
        n, f = n + 1, f.f_back
    return n


class InstructionCounter:
    """User-space instructions retired by the calling thread (perf_event_open), or unavailable
    (`fd` None) where the kernel or the virtual machine does not expose the counter. Unlike time,
    the count does not depend on which core, cache state or neighbour a process got, so it shows
    a hook's cost where process-to-process timing noise is larger than the cost itself."""

    PERF_TYPE_HARDWARE, PERF_COUNT_HW_INSTRUCTIONS, SYS_PERF_EVENT_OPEN = 0, 1, 298

    def __init__(self):
        self.fd = None
        if platform.machine() != "x86_64":
            return
        import ctypes
        import struct

        attr = bytearray(128)  # struct perf_event_attr, PERF_ATTR_SIZE_VER7
        struct.pack_into("=IIQ", attr, 0, self.PERF_TYPE_HARDWARE, len(attr), self.PERF_COUNT_HW_INSTRUCTIONS)
        struct.pack_into("=Q", attr, 40, (1 << 5) | (1 << 6))  # exclude_kernel, exclude_hv
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        buf = (ctypes.c_char * len(attr)).from_buffer(attr)
        fd = libc.syscall(ctypes.c_long(self.SYS_PERF_EVENT_OPEN), buf, ctypes.c_int(0), ctypes.c_int(-1),
                          ctypes.c_int(-1), ctypes.c_ulong(0))
        self.fd = fd if fd >= 0 else None

    def read(self):
        if self.fd is None:
            return 0
        return int.from_bytes(os.read(self.fd, 8), "little")


COUNTER = None


def timed_loop(loop, seq, iterations, sync):
    """(ns per iteration, user-space instructions per iteration or None) of one loop."""
    sites = [loop.site0, loop.site1, loop.site2, loop.site3, loop.site4, loop.site5]
    mask = len(seq) - 1
    sync()
    instr = COUNTER.read() if COUNTER else 0
    start = time.perf_counter_ns()
    for i in range(iterations):
        sites[i % SITES](seq[i & mask])
    sync()
    ns = (time.perf_counter_ns() - start) / iterations
    if COUNTER is None or COUNTER.fd is None:
        return ns, None
    return ns, (COUNTER.read() - instr) / iterations


def nested(depth, *args):
    if depth <= 1:
        return timed_loop(*args)
    ns, instr = nested(depth - 1, *args)
    return ns + 0.0, instr


# module level + main + measure + run_loops + NESTED x nested + timed_loop + site<n> + step
# + make (the function that calls torch.empty) = PY_FRAMES
NESTED = PY_FRAMES - 8


def run_loops(loop, seq, iterations, sync, pass_through=None):
    """Best of 5 timed loops: (ns, instructions or None, Python frames, best ns passing through
    or None, events made while passing through). With `pass_through` (memsnap's
    memsnap_debug_pass_through), each recorded loop is followed by the same loop with this
    thread's calls passing through memsnap unrecorded: the two are timed in one process, so the
    difference is free of the process-to-process spread. Each phase frees what it allocated
    (drain) before the other starts, so the record stays exact for the recorded phases."""
    # The Python frames on the stack where make(size) calls torch.empty, counted on the timed
    # path itself: one iteration of a separate window, a probe standing in for make.
    seen = []

    def probe(size):
        seen.append(python_depth())  # probe's frame included: it stands where make's does

    nested(NESTED, Loop(probe), [512], 1, lambda: None)
    frames = seen[0]
    nested(NESTED, loop, seq, iterations // 4, sync)  # warm-up
    loops, passed, passed_events = [], [], 0
    for _ in range(5):
        loops.append(nested(NESTED, loop, seq, iterations, sync))
        if pass_through is not None:
            loop.drain()
            sync()
            before = loop.events
            pass_through(1)
            passed.append(nested(NESTED, loop, seq, iterations, sync)[0])
            loop.drain()
            sync()
            pass_through(0)
            passed_events += loop.events - before
    best = min(ns for ns, _ in loops)
    counted = [instr for _, instr in loops if instr is not None]
    loop.drain()
    sync()
    return best, (min(counted) if counted else None), frames, (min(passed) if passed else None), passed_events


def recorder_check(torch):
    """What PyTorch's recorder kept: trace entries, and alloc/free entries without frames."""
    snap = torch.cuda.memory._snapshot()
    entries = [e for trace in snap.get("device_traces", []) for e in trace]
    mine = [e for e in entries if e.get("action") in ("alloc", "free_requested")]
    return {"recorder_entries": len(entries),
            "recorder_entries_without_frames": sum(1 for e in mine if not e.get("frames"))}


def measure(iterations):
    import torch

    rec = os.environ.get("HOOK_COST_RECORDER")
    if rec:
        torch.cuda.memory._record_memory_history(max_entries=RECORDER_MAX_ENTRIES, stacks=rec)
    torch.empty(1, device="cuda")
    # Every configuration's loop runs on the same core, pinned after CUDA (and memsnap's
    # writer thread) started, so helper threads keep the whole machine.
    if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > 3:
        os.sched_setaffinity(0, {2})
    res = {"allocator_backend": torch.cuda.get_allocator_backend(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(), "python": platform.python_version()}
    global COUNTER
    COUNTER = InstructionCounter()
    pass_through = None
    if os.environ.get("LD_PRELOAD"):
        import ctypes

        pass_through = getattr(ctypes.CDLL(None), "memsnap_debug_pass_through", None)  # None: an older build
    loop = Loop(lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"))
    best, instr, frames, best_passed, passed_events = run_loops(loop, size_sequence(), iterations,
                                                                torch.cuda.synchronize, pass_through)
    # loop_events: what memsnap should have recorded (the passing-through phases are not).
    res.update(ns_per_iteration=round(best, 1), loop_events=loop.events - passed_events, python_frames=frames)
    if best_passed is not None:
        res["ns_passing_through"] = round(best_passed, 1)
    if instr is not None:
        res["instructions_per_iteration"] = round(instr, 1)
    if rec and os.environ.get("HOOK_COST_CHECK_RECORDER"):
        res.update(recorder_check(torch))
    print(json.dumps(res))


# ----------------------------------------------------------------------------------------------
# Driver


def child_env(conf, stacks, rec, lib, folder, context, check_recorder=False):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMSNAP_", "LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF", "HOOK_COST_"))}
    env.update(SAFE_ENV)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    if stacks:
        env.update(LD_PRELOAD=lib, MEMSNAP_STACKS=stacks, MEMSNAP_CONTEXT=context, MEMSNAP_AT_EXIT="1",
                   MEMSNAP_QUIET="1", MEMSNAP_FOLDER=folder)
    if rec:
        env["HOOK_COST_RECORDER"] = rec
        if check_recorder:
            env["HOOK_COST_CHECK_RECORDER"] = "1"
    return env


def run_child(env, iterations, timeout=150):
    """(result dict, None) or (None, error text)."""
    try:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", str(iterations)],
                             env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    if out.returncode != 0:
        return None, f"exit {out.returncode}: {out.stderr[-800:]}"
    try:
        return json.loads(out.stdout.strip().splitlines()[-1]), None
    except (ValueError, IndexError):
        return None, f"unreadable output: {out.stdout[-300:]!r} {out.stderr[-300:]!r}"


def drive(lib, rounds, iterations, context, run=run_child):
    """Runs every configuration `rounds` times, interleaved; returns the results per config."""
    lib = os.path.abspath(lib)
    if not os.path.exists(lib):
        sys.exit(f"hook_cost_torch.py: {lib} not found")
    res = {name: {"runs": [], "errors": [], "tally": Tally() if stacks else None}
           for name, _, stacks, _, _ in CONFIGS}
    for rnd in range(rounds):
        order = CONFIGS if rnd % 2 == 0 else list(reversed(CONFIGS))
        for name, conf, stacks, rec, _ in order:
            folder = tempfile.mkdtemp(prefix="hook_cost_torch.")
            try:
                # The recorder's check (torch.cuda.memory._snapshot(), seconds with 'all' stacks)
                # runs in the first round only, outside the timed loops.
                row_lib = OTHER_LIBS.get(name, lib)
                r, err = run(child_env(conf, stacks, rec, row_lib, folder, context, rnd == 0), iterations)
                if err:
                    res[name]["errors"].append(err)
                    continue
                if conf == ASYNC and r.get("allocator_backend") != "cudaMallocAsync":
                    res[name]["errors"].append(f"allocator backend {r.get('allocator_backend')!r}, not cudaMallocAsync")
                    continue
                if stacks:
                    r["snapshot"] = read_counts(folder)
                    res[name]["tally"].add(r["snapshot"], r["loop_events"])
                res[name]["runs"].append(r)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    return res


def recorder_ok(runs):
    checked = [r for r in runs if "recorder_entries" in r]
    return bool(checked) and all(r["recorder_entries"] > 0 and not r["recorder_entries_without_frames"]
                                 for r in checked)


def best_ns(row):
    return min(r["ns_per_iteration"] for r in row["runs"]) if row["runs"] else None


def figures(res):
    """Per config: (ns per iteration or None, ns per event over baseline or None, why not)."""
    out = {}
    for name, _, stacks, rec, base in CONFIGS:
        row, ns, why = res[name], best_ns(res[name]), None
        if row["errors"]:
            why = f"ERROR in {len(row['errors'])} of {len(row['errors']) + len(row['runs'])} runs"
        elif row["tally"] is not None and row["tally"].verdict():
            why = row["tally"].verdict()
        elif rec and not recorder_ok(row["runs"]):
            why = "VOID (recorder unchecked, kept no entries, or kept entries without frames)"
        if why:
            out[name] = (None, None, why)
            continue
        per_event = None
        if base:
            b = out.get(base, (None,))[0]
            if b is None:
                why = f"no baseline ({base})"
            else:
                per_event = (ns - b) / 2
        out[name] = (ns, per_event, why)
    return out


def report(res, argv, rounds, iterations, context, elapsed):
    fig = figures(res)
    any_run = next((r for row in res.values() for r in row["runs"]), {})
    lines = [
        f"command: `python3 {' '.join(argv)}`",
        f"date: {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}  machine: {gpu_line(any_run)}, "
        f"{os.cpu_count()} CPU cores, {platform.machine()}; torch {any_run.get('torch', '?')}, "
        f"CUDA {any_run.get('cuda', '?')}, Python {any_run.get('python', platform.python_version())}; "
        f"took {elapsed:.0f} s",
        "",
        f"Per iteration: drop the oldest of {WINDOW} live tensors, allocate one (size from a fixed set of "
        f"{N_SIZES}, 512 B .. 1 MiB), {SITES} call sites in rotation, "
        f"{any_run.get('python_frames', PY_FRAMES)} Python frames at torch.empty; an event is one alloc "
        f"or one free; per event = (iteration - baseline) / 2. memsnap rows: backend:cudaMallocAsync, "
        f"MEMSNAP_CONTEXT={context}; recorder rows: default caching allocator, "
        f"_record_memory_history(stacks=..., max_entries={RECORDER_MAX_ENTRIES}), context='all' (frees "
        f"carry their own stack); its trace entries and their frames are checked in the first round. Best over {rounds} interleaved rounds x 5 loops of {iterations} "
        f"iterations. memsnap counts come from each run's exit snapshot (recorded: per run; dropped, "
        f"stackless: summed over runs); a row that lost anything is VOID.",
        "",
        "| configuration | ns per iteration | ns per event over its baseline | events recorded per run "
        "| dropped | stackless |",
        "|---|---|---|---|---|---|",
    ]
    for name, _, stacks, rec, base in CONFIGS:
        ns, per_event, why = fig[name]
        row = res[name]
        t = row["tally"]
        if t is not None:
            counts = [t.recorded_text(), str(t.dropped), str(t.stackless)]
        elif rec:
            kept = sorted(r["recorder_entries"] for r in row["runs"] if "recorder_entries" in r)
            counts = ["—", "—", "—"]
            if kept:
                counts[0] = f"recorder kept {kept[0]}" + (f"–{kept[-1]}" if kept[-1] != kept[0] else "")
        else:
            counts = ["—", "—", "—"]
        if why:
            cost = ["—", why]
        else:
            cost = [f"{ns:.0f}", "—" if base is None else f"{per_event:.0f}"]
        lines.append(f"| {name} | {cost[0]} | {cost[1]} | " + " | ".join(counts) + " |")
    lines += ["", "| stacks | PyTorch recorder ns/event | memsnap ns/event | recorder / memsnap |",
              "|---|---|---|---|"]
    for stacks, rec_name, ms_name in RATIOS:
        r_ns, m_ns = fig[rec_name][1], fig[ms_name][1]
        r_txt = fig[rec_name][2] or f"{r_ns:.0f}"
        m_txt = fig[ms_name][2] or f"{m_ns:.0f}"
        if r_ns is None or m_ns is None:
            ratio = "—"
        elif m_ns <= 0:
            ratio = "n/a (memsnap within noise of its baseline)"
        else:
            ratio = f"{r_ns / m_ns:.1f}x"
        lines.append(f"| {stacks} | {r_txt} | {m_txt} | {ratio} |")
    lines += same_process_table(res, fig)
    lines += instruction_table(res, fig)
    # Every run's figure, so that the spread between processes is in plain sight: a
    # difference smaller than it says nothing.
    lines += ["", "Every run (ns per iteration, sorted): " + "; ".join(
        f"{name}: " + ", ".join(f"{r['ns_per_iteration']:.0f}" for r in
                                sorted(res[name]["runs"], key=lambda r: r["ns_per_iteration"]))
        for name, *_ in CONFIGS)]
    errors = [(name, e) for name, row in res.items() for e in row["errors"]]
    if errors:
        lines += ["", "Errors:"] + [f"- {name}: {e.strip().splitlines()[-1] if e.strip() else e}"
                                     for name, e in errors]
    return "\n".join(lines)


def same_process_table(res, fig):
    """Per memsnap configuration: recorded loop vs the same loop passing through memsnap, in each
    run's own process (see run_loops). Robust to the spread between processes, which on a shared
    virtual machine can exceed the hook's whole cost."""
    rows = []
    for name, _, stacks, _, _ in CONFIGS:
        runs = [r for r in res[name]["runs"] if "ns_passing_through" in r]
        if not stacks or not runs:
            continue
        why = fig[name][2]
        deltas = sorted((r["ns_per_iteration"] - r["ns_passing_through"]) / 2 for r in runs)
        if why:
            rows.append(f"| {name} | {why} | — | — |")
            continue
        median = deltas[len(deltas) // 2] if len(deltas) % 2 else (deltas[len(deltas) // 2 - 1] + deltas[len(deltas) // 2]) / 2
        rows.append(f"| {name} | {median:.0f} | {deltas[0]:.0f} .. {deltas[-1]:.0f} | {len(deltas)} |")
    if not rows:
        return []
    return ["", "Same process: each run also times its loop with the thread's calls passing through memsnap "
            "unrecorded (memsnap_debug_pass_through), alternating with the recorded loop; per event = "
            "(recorded - passing through) / 2, best of 5 loops each, per run:", "",
            "| configuration | ns per event, median over runs | range over runs | runs |", "|---|---|---|---|"] + rows


def instruction_table(res, fig):
    """User-space instructions the loop's thread retired per iteration (fewest over a config's
    runs), where the counter was available; a VOID row stays void."""
    def fewest(name):
        counted = [r["instructions_per_iteration"] for r in res[name]["runs"] if "instructions_per_iteration" in r]
        return min(counted) if counted else None

    if all(fewest(name) is None for name, *_ in CONFIGS):
        return ["", "Instructions: the loop thread's counter (perf_event_open) was not available here."]
    lines = ["", "Instructions retired by the loop's thread in user space (perf_event_open; the same in "
             "every process, unlike time; the writer thread's work is not in them):", "",
             "| configuration | instructions per iteration | per event over its baseline |", "|---|---|---|"]
    for name, _, _, _, base in CONFIGS:
        mine, why = fewest(name), fig[name][2]
        if why or mine is None:
            lines.append(f"| {name} | {why or '—'} | — |")
            continue
        over = "—"
        if base and fewest(base) is not None:
            over = f"{(mine - fewest(base)) / 2:.0f}"
        lines.append(f"| {name} | {mine:.0f} | {over} |")
    return lines


def gpu_and_driver():
    """(the first GPU's name, the driver's version) as nvidia-smi says, or None."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if q.returncode == 0 and q.stdout.strip():
            name, _, driver = q.stdout.strip().splitlines()[0].partition(",")
            return name.strip(), driver.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None


def gpu_line(run):
    found = gpu_and_driver()
    return f"{found[0]}, driver {found[1]}" if found else run.get("gpu", "GPU ?")


def main(argv):
    if len(argv) >= 2 and argv[1] == "--measure":
        measure(int(argv[2]) if len(argv) > 2 else 20000)
        return
    if len(argv) == 1:
        measure(20000)
        return
    args = argv[1:]
    if args[0] == "drive":  # older spelling: drive LIBMEMSNAP
        args = ["--lib"] + args[1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", required=True, help="libmemsnap.so to preload")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=20000, help="iterations per timed loop (5 per run)")
    p.add_argument("--memsnap-context", choices=["alloc", "all"], default="alloc")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--also-lib", action="append", default=[], metavar="NAME=PATH",
                   help="also time this build of the library with MEMSNAP_STACKS=all, in the same rounds")
    a = p.parse_args(args)
    for spec in a.also_lib:
        name, sep, path = spec.partition("=")
        if not sep or not name or not os.path.exists(path):
            sys.exit(f"hook_cost_torch.py: --also-lib wants NAME=PATH of an existing library, not {spec!r}")
        row = f"async/memsnap-all [{name}]"
        OTHER_LIBS[row] = os.path.abspath(path)
        CONFIGS.insert(4, (row, ASYNC, "all", None, "async/no-preload"))
    t0 = time.time()
    res = drive(a.lib, a.rounds, a.iterations, a.memsnap_context)
    print(report(res, [os.path.relpath(argv[0])] + argv[1:], a.rounds, a.iterations, a.memsnap_context,
                 time.time() - t0))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({name: {"runs": row["runs"], "errors": row["errors"]} for name, row in res.items()},
                      f, indent=1)


if __name__ == "__main__":
    main(sys.argv)
