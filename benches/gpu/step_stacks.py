"""What one memsnap event costs inside a real training step, and what its stack capture did
there: the in-process companion of benches/gpu/step_time.py.

    python3 benches/gpu/step_stacks.py --lib target/gpu-bin/final/libmemsnap.so \\
        [--stats-lib target/gpu-bin/stats/libmemsnap.so [--stats-lib-b OTHER_STATS.so]
        [--stats-rounds 3] [--stats-stacks none,python,all]] --out $OUT [--cycles 30] [--block 4]
        [--routes tensor,default] [--stacks none,python,all] [--lib-b OTHER.so --label-b NAME]

Why: step_time.py gives the step time users feel (memsnap against another process, and
against itself passing through); this script gives the cost per event and, with a
capture-stats build, its parts; the loops of hook_cost_torch.py and torch_blocks.py call the
allocator back to back with everything memsnap touches in the caches, at one stack. Here the
workload is step_time.py's transformer step (transformer_step.py's TorchWorkload, same
sizes), and recording is switched on and off inside one process
(memsnap_debug_pass_through, a bench-hooks build), beside PyTorch's recorder switched on and
off in the same process, so the per-event figure is a paired difference at the same machine
state. Autograd runs its backward pass on the calling thread
(torch.autograd.set_multithreading_enabled(False)): the switch is per thread, and with the
default backward thread the main thread only waits during backward anyway.

One process per route (tensor: PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync; default: the
caching allocator, seen through its trace tracker) and MEMSNAP_STACKS (none, python, all), one
after another. Each builds the model, does --warmup recorded steps (stacks first seen there),
then --cycles cycles of turns: memsnap off, memsnap on, and in the default route with python
or all stacks, PyTorch's recorder on (stacks the same, context "all", memsnap off meanwhile);
the order rotates every cycle. A turn is one settling step and --block timed steps; a turn's
figure is its median step. Per cycle: on - off (and recorder - off); reported: the median over
cycles with its interquartile range, in ms per step and in ns per event. Events per step:
memsnap's events_recorded between two snapshots (memsnap_dump_path) around the cycles, over the
steps recorded in between; PyTorch's: its trace entries in one step with its history cleared.
Every memsnap process's snapshots must say 0 dropped and 0 stackless, else its figures are VOID.

--lib-b: a second library timed the same way in processes of its own, interleaved with
--lib's (process by process), for A/B comparisons of two builds.

--stats-lib (a build with --features capture-stats): one more process per route and stacks
setting (--stats-stacks: python and all unless told) records --stats-steps steps after the
warm-up and reports, per walk,
what the captures did (memsnap_debug_capture_stats: native steps unwound and taken from earlier
paths, whole paths taken at once and paths left midway, stack words checked, nodes made, rule
misses, frames, truncations; Python frames), and the time-stamp-counter ticks of each part:
the whole recording of every event (device query, clock, stack path, push: with stacks none,
the hook's floor in the step), the stack path, the walks, the send, and alone the device query
of an allocation and the push of a stackless event. Not a step time: its counters
are atomic adds. --stats-lib-b: a second capture-stats build, its processes alternating with
--stats-lib's (labelled --label-a and --label-b), --stats-rounds processes of each per route
and stacks setting: the per-part times of two builds compared on one machine. Without --lib,
only the stats processes run.

Output: OUT/step_stacks.json and OUT/step_stacks.md (also printed).
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# This folder, the benchmarks' Python helpers (benches/python) and the helpers the GPU
# checks share with the benchmarks (scripts/gpu).
sys.path[:0] = [HERE, os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "..", "scripts", "gpu")]
from hook_cost_torch import ASYNC, SAFE_ENV  # noqa: E402
from snapshot_counts import read_counts  # noqa: E402
from snaputil import memsnap_dump  # noqa: E402
from transformer_step import add_workload_args  # noqa: E402

# memsnap_debug_capture_stats's order (src/capture/stats.rs, `Stat`).
STAT_NAMES = ["walks", "walks_reused", "steps_unwound", "steps_reused", "reads_checked", "whole_paths", "paths_left", "rule_misses",
              "rule_misses_cold", "rule_misses_conflict", "rule_misses_first_frame", "framehop_steps",
              "walks_at_step_limit", "native_frames", "native_truncated", "python_walks", "python_frames", "native_ticks", "python_ticks", "send_ticks", "stack_event_ticks", "stack_events",
              "nodes_made", "path_resets", "paths_not_holding", "event_ticks", "events", "timer_ticks",
              "device_ticks", "device_queries", "push_ticks", "pushes", "ticks_per_ms"]


def quartiles(values):
    v = sorted(values)
    if not v:
        return None, None, None
    if len(v) < 4:
        return v[0], statistics.median(v), v[-1]
    q = statistics.quantiles(v, n=4)
    return q[0], statistics.median(v), q[2]


def workload_args(a):
    return argparse.Namespace(d_model=a.d_model, heads=a.heads, vocab=a.vocab, seq=a.seq, layers=a.layers,
                              batch=a.batch, dtype=a.dtype)


def lib_calls():
    lib = ctypes.CDLL(None)
    return {name: getattr(lib, name, None) for name in ("memsnap_debug_pass_through", "memsnap_debug_capture_stats")}


def snapshot_counts(tag):
    """read_counts of a snapshot memsnap writes now (its folder's newest file), or None."""
    path = memsnap_dump(tag)
    return read_counts(os.path.dirname(path)) if path else None


def capture_stats(calls):
    fn = calls["memsnap_debug_capture_stats"]
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    fn.restype = ctypes.c_size_t
    buf = (ctypes.c_uint64 * 128)()
    n = min(fn(buf, 128), 128)
    stats = {name: int(buf[i]) for i, name in enumerate(STAT_NAMES)}
    stats["missed"] = [int(buf[i]) for i in range(len(STAT_NAMES), n) if buf[i]]
    return stats


def where(address):
    """module+offset of a code address in this process (its /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi and len(parts) >= 6:
                return f"{os.path.basename(parts[5])}+{address - lo + int(parts[2], 16):#x}"
    return f"{address:#x}"


def child(a):
    """One process: the workload, then the cycles (or the stats run); JSON on the last line."""
    from transformer_step import TorchWorkload  # imports torch: only in the processes that run it

    wl = TorchWorkload(workload_args(a))
    torch = wl.torch
    torch.autograd.set_multithreading_enabled(False)
    calls = lib_calls()
    out = {"route": a.route, "stacks": a.stacks, "torch": torch.__version__,
           "allocator_backend": torch.cuda.get_allocator_backend()}
    for _ in range(a.warmup):
        wl.step()
    if a.stats:
        before = capture_stats(calls)
        for _ in range(a.stats_steps):
            wl.step()
        after = capture_stats(calls)
        out["stats"] = {k: after[k] - before.get(k, 0) for k in after if k not in ("missed", "ticks_per_ms")}
        out["stats"]["ticks_per_ms"] = after["ticks_per_ms"]
        out["missed"] = sorted({("first " if k >> 63 else "") + where(k & ~(1 << 63)) for k in after["missed"]})
        out["stats_steps"] = a.stats_steps
        out["counts"] = snapshot_counts("stats")
        print(json.dumps(out))
        return
    switch = calls["memsnap_debug_pass_through"]
    if a.stacks != "baseline" and switch is None:
        raise SystemExit("this libmemsnap.so has no memsnap_debug_pass_through (build with --features bench-hooks)")
    recorder_mode = a.stacks if (a.route == "default" and a.stacks in ("python", "all")) else None

    def memsnap(on):
        if switch is not None:
            switch(0 if on else 1)

    def recorder(on):
        history = torch.cuda.memory._record_memory_history
        if on:
            history(enabled="all", context="all", stacks=recorder_mode, max_entries=100000)
        else:
            history(enabled=None)

    def turn(kind):
        memsnap(kind == "memsnap")
        if kind == "recorder":
            recorder(True)
        wl.step()  # settles: caches and the GPU change hands
        times = []
        for _ in range(a.block):
            t0 = time.perf_counter()
            wl.step()
            times.append(time.perf_counter() - t0)
        if kind == "recorder":
            recorder(False)
        memsnap(False)
        return statistics.median(times)

    kinds = ["off", "memsnap"] + (["recorder"] if recorder_mode else [])
    start = snapshot_counts("start") if switch else None
    steps_on = 0
    cycles = []
    for c in range(a.cycles):
        order = kinds[c % len(kinds):] + kinds[:c % len(kinds)]
        if c % 2:
            order.reverse()
        cycle = {}
        for kind in order:
            cycle[kind] = turn(kind)
            if kind == "memsnap":
                steps_on += a.block + 1
        cycles.append(cycle)
    end = snapshot_counts("end") if switch else None
    out["cycles"] = cycles
    out["steps_recorded"] = steps_on
    out["counts_start"], out["counts_end"] = start, end
    if recorder_mode:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=recorder_mode,
                                                 max_entries=100000, clear_history=True)
        wl.step()
        snap = torch.cuda.memory._snapshot()
        recorder(False)
        out["recorder_entries_per_step"] = sum(len(t) for t in snap.get("device_traces", []))
    print(json.dumps(out))


def run_child(a, lib, route, stacks, stats, folder):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMSNAP_", "LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF"))}
    env.update(SAFE_ENV)
    if route == "tensor":
        env["PYTORCH_CUDA_ALLOC_CONF"] = ASYNC
    os.makedirs(folder, exist_ok=True)
    env.update(LD_PRELOAD=os.path.abspath(lib), MEMSNAP_STACKS=stacks, MEMSNAP_FOLDER=folder,
               MEMSNAP_AT_EXIT="1", MEMSNAP_QUIET="1")
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--route", route, "--child-stacks", stacks,
            "--warmup", str(a.warmup), "--cycles", str(a.cycles), "--block", str(a.block),
            "--stats-steps", str(a.stats_steps)]
    for k in ("d_model", "heads", "vocab", "seq", "layers", "batch"):
        argv += ["--" + k.replace("_", "-"), str(getattr(a, k))]
    argv += ["--dtype", a.dtype]
    if stats:
        argv.append("--stats")
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.child_timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"route": route, "stacks": stacks, "error": (p.stderr or p.stdout)[-1500:]}
    res = json.loads(lines[-1])
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def void_reason(res):
    for key in ("counts_start", "counts_end", "counts"):
        c = res.get(key)
        if key in res and c is None:
            return "VOID (no snapshot)"
        if c and (c["dropped"] or c["stackless"]):
            return f"VOID ({c['dropped']} dropped, {c['stackless']} stackless)"
    return None


def summarize(res):
    """Per-event figures of one timing process."""
    cyc = res["cycles"]
    s = {"off_ms": quartiles([c["off"] * 1e3 for c in cyc])}
    start, end = res.get("counts_start"), res.get("counts_end")
    events = (end["recorded"] - start["recorded"]) / res["steps_recorded"] if start and end else None
    s["events_per_step"] = events
    for kind, per_step in (("memsnap", events), ("recorder", res.get("recorder_entries_per_step"))):
        if not cyc or kind not in cyc[0]:
            continue
        diffs = [(c[kind] - c["off"]) for c in cyc]
        s[kind + "_ms"] = quartiles([d * 1e3 for d in diffs])
        s[kind + "_pct"] = quartiles([(c[kind] / c["off"] - 1) * 100 for c in cyc])
        if per_step:
            s[kind + "_ns_per_event"] = quartiles([d * 1e9 / per_step for d in diffs])
            s[kind + "_events_per_step"] = per_step
    return s


def fmt(q, digits=0):
    if not q or q[1] is None:
        return "—"
    lo, mid, hi = q
    return f"{mid:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def table(doc):
    lines = ["| library | route | stacks | events/step | step off ms | memsnap ns/event | memsnap % | "
             "recorder ns/event | recorder % |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["timing"]:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['route']} | {r['stacks']} | ERROR: "
                         f"{r['error'].strip().splitlines()[-1][:120] if r['error'].strip() else '?'} |||||||")
            continue
        void = void_reason(r)
        s = r["summary"]
        ev = f"{s['events_per_step']:.0f}" if s.get("events_per_step") else "—"
        mem = void or fmt(s.get("memsnap_ns_per_event"))
        pct = "—" if void else fmt(s.get("memsnap_pct"), 2)
        lines.append(f"| {r['label']} | {r['route']} | {r['stacks']} | {ev} | {fmt(s['off_ms'], 2)} | {mem} | {pct} | "
                     f"{fmt(s.get('recorder_ns_per_event'))} | {fmt(s.get('recorder_pct'), 2)} |")
    if doc.get("stats"):
        lines += ["", "| build | route | stacks | events/step | walks | steps unwound/walk | steps reused/walk | "
                  "walks reusing | whole paths/walk | paths not holding/walk | paths left/walk | words checked/walk | nodes made/walk | path resets | "
                  "rule misses/walk (cold, conflict, first frame) | framehop steps/walk | "
                  "at step limit | native frames/walk | truncated | Python frames/walk |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in doc["stats"]:
            if "error" in r:
                lines.append(f"| {r.get('label', '')} | {r['route']} | {r['stacks']} | ERROR ||||||||||||||||")
                continue
            st, w = r["stats"], max(r["stats"]["walks"], 1)
            pw = max(st["python_walks"], 1)
            per = r["stats_steps"]
            lines.append(
                f"| {r.get('label', '')} | {r['route']} | {r['stacks']} | "
                f"{st['events'] / per:.0f} | {st['walks']} | "
                f"{st['steps_unwound'] / w:.1f} | {st['steps_reused'] / w:.1f} | "
                f"{100 * st['walks_reused'] / w:.0f}% | {st['whole_paths'] / w:.2f} | "
                f"{st['paths_not_holding'] / w:.2f} | {st['paths_left'] / w:.2f} | "
                f"{st['reads_checked'] / w:.1f} | {st['nodes_made'] / w:.2f} | {st['path_resets']} | "
                f"{st['rule_misses'] / w:.2f} ({st['rule_misses_cold'] / w:.2f}, {st['rule_misses_conflict'] / w:.2f}, "
                f"{st['rule_misses_first_frame'] / w:.2f}) | {st['framehop_steps'] / w:.2f} | "
                f"{100 * st['walks_at_step_limit'] / w:.0f}% | {st['native_frames'] / w:.1f} | "
                f"{100 * st['native_truncated'] / w:.0f}% | {st['python_frames'] / pw:.1f} |"
                + ("" if not void_reason(r) else f" {void_reason(r)}"))
    if doc.get("stats"):
        lines += ["", "Time in the recording and its parts (time-stamp counter around each part; \"counter "
                  "reads\": an empty timed region once per event, what the reads add to each figure):", "",
                  "| build | route | stacks | recording ns/event (every event) | counter reads ns | "
                  "stack path ns/stacked event | native walk ns | Python walk ns | send ns | "
                  "device query ns | stackless push ns |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in doc["stats"]:
            if "error" in r:
                continue
            st = r["stats"]
            ns = 1e6 / max(st["ticks_per_ms"], 1)
            ev = max(st["stack_events"], 1)
            lines.append(f"| {r.get('label', '')} | {r['route']} | {r['stacks']} | "
                         f"{st['event_ticks'] * ns / max(st['events'], 1):.0f} | "
                         f"{st['timer_ticks'] * ns / max(st['events'], 1):.0f} | {st['stack_event_ticks'] * ns / ev:.0f} | "
                         f"{st['native_ticks'] * ns / max(st['walks'], 1):.0f} | "
                         f"{st['python_ticks'] * ns / max(st['python_walks'], 1):.0f} | {st['send_ticks'] * ns / ev:.0f} | "
                         f"{st.get('device_ticks', 0) * ns / max(st.get('device_queries', 0), 1):.0f} | "
                         f"{st.get('push_ticks', 0) * ns / max(st.get('pushes', 0), 1):.0f} |")
    for r in doc.get("stats") or []:
        if r.get("missed"):
            lines.append(f"\n{r['route']}/{r['stacks']}: latest rule misses at " + ", ".join(r["missed"]))
    return "\n".join(lines)


def drive(a):
    os.makedirs(a.out, exist_ok=True)
    doc = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "timing": [], "stats": []}
    try:
        doc["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
    except OSError:
        doc["gpu"] = None
    libs = ([(a.label_a, a.lib)] if a.lib else []) + ([(a.label_b, a.lib_b)] if a.lib and a.lib_b else [])
    n = 0
    for route in a.routes.split(","):
        for stacks in [s for s in a.stacks.split(",") if s]:
            for label, lib in (libs if n % 2 == 0 else list(reversed(libs))):
                folder = os.path.join(a.out, "snapshots", f"{label}-{route}-{stacks}")
                res = run_child(a, lib, route, stacks, False, folder)
                res["label"] = label
                if "error" not in res:
                    res["summary"] = summarize(res)
                doc["timing"].append(res)
                print(f"[step_stacks] {label} {route}/{stacks}: "
                      f"{res.get('summary', {}).get('memsnap_ns_per_event') or res.get('error', '')[-200:]}",
                      file=sys.stderr, flush=True)
            n += 1
    stats_libs = [(a.label_a, a.stats_lib)] if a.stats_lib else []
    if a.stats_lib_b:
        stats_libs.append((a.label_b, a.stats_lib_b))
    for round_ in range(a.stats_rounds if stats_libs else 0):
        # The two builds alternate process by process, and which goes first alternates by
        # round: a machine that drifts moves both alike.
        order = stats_libs if round_ % 2 == 0 else list(reversed(stats_libs))
        for route in a.routes.split(","):
            for stacks in [s for s in a.stats_stacks.split(",") if s]:
                for label, lib in order:
                    folder = os.path.join(a.out, "snapshots", f"stats-{label}-{route}-{stacks}-{round_}")
                    res = run_child(a, lib, route, stacks, True, folder)
                    res["label"] = label
                    doc["stats"].append(res)
    md = table(doc)
    with open(os.path.join(a.out, "step_stacks.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(a.out, "step_stacks.md"), "w") as f:
        f.write(f"{doc['date']}, {doc['gpu']}\n\n{md}\n")
    print(md)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib")
    p.add_argument("--lib-b", help="a second library, timed in processes of its own beside --lib's")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--stats-lib", help="a capture-stats build: the per-walk counts")
    p.add_argument("--out", default=".")
    p.add_argument("--routes", default="tensor,default")
    p.add_argument("--stacks", default="none,python,all", help="the timed stacks settings ('' for none)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--cycles", type=int, default=30)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--stats-steps", type=int, default=20)
    p.add_argument("--stats-lib-b", help="a second capture-stats build, in processes of its own beside --stats-lib's "
                   "(labelled --label-b)")
    p.add_argument("--stats-rounds", type=int, default=1, help="processes per stats build, route and stacks")
    p.add_argument("--stats-stacks", default="python,all",
                   help="the stacks settings of the stats processes (none: the recording floor alone)")
    p.add_argument("--child-timeout", type=float, default=300)
    add_workload_args(p)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--route", help=argparse.SUPPRESS)
    p.add_argument("--child-stacks", help=argparse.SUPPRESS)
    p.add_argument("--stats", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        a.stacks = a.child_stacks
        child(a)
        return
    if not a.lib and not a.stats_lib:
        p.error("--lib or --stats-lib is required")
    drive(a)


if __name__ == "__main__":
    main()
