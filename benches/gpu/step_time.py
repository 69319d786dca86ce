"""The figure users feel: the step time of a small transformer's training step with memsnap
recording, against the same allocator without memsnap and against PyTorch's own recorder.

    python3 benches/gpu/step_time.py --lib target/gpu-bin/libmemsnap.so --cli target/gpu-bin/memsnap \\
        --out $OUT [--budget-s 520] [--cycles 60] [--block 5] [--warmup 30] [--memsnap-context alloc|all]
        [--isolate] (every other thread of each process, memsnap's writer included, off the stepping
        thread's core and its SMT siblings)
        [--routes tensor,default] [--stacks python,all,none] (only these routes and memsnap stack
        modes: fewer processes a round, so more rounds in the same time; each route keeps its
        process without memsnap, and the default route PyTorch's recorder for the stacks kept)
        [--dtype bf16|fp32] [--layers 4] [--d-model 512] [--heads 8] [--batch 16] [--seq 256] [--vocab 8192]
    python3 benches/gpu/step_time.py --merge OUT1/step_time.json OUT2/step_time.json --out DIR
        (the rounds of several runs, e.g. several device commands of at most 600 s each, as one)
    python3 benches/gpu/step_time.py --dry-run --out /tmp/step-time-dry
        (no GPU, no torch, no preload: a fake step that busy-waits about 2 ms, with jitter and a
        drift all processes share, and fake snapshots; runs the whole orchestration, the checks
        and the statistics in about 15 s)

Workload (the same in every process: torch.manual_seed(0)): a causal language model of
nn.TransformerEncoder layers (4 x d_model 512, 8 heads, FF 2048, pre-norm, dropout 0.1) between
a token embedding (vocabulary 8192) and an output head, batch 16 x sequence 256, AdamW, bf16
autocast. One step = forward, cross-entropy loss, backward, optimizer.step(),
zero_grad(set_to_none=True), torch.cuda.synchronize(), timed with time.perf_counter. The GPU
work is a few ms; the host side (Python, autograd, launches, the allocator, a recorder) sets the
step time (about 8-12 ms on an H200), so allocator costs show in it.

Routes and configurations, one process each (memsnap is loaded by LD_PRELOAD at its start):
- tensor mode (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: memsnap sees every tensor as a
  CUDA call): no memsnap; memsnap MEMSNAP_STACKS=python; memsnap MEMSNAP_STACKS=all; memsnap
  MEMSNAP_STACKS=none (measured against itself only: the hook's floor in a real step).
- default (PyTorch's caching allocator: memsnap sees its blocks through the allocator's trace
  tracker): no memsnap; memsnap python; memsnap all; memsnap none. PyTorch's recorder,
  torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python" or
  "all", max_entries=100000), records in this route only: it is switched on and off inside the
  no-memsnap process of the default route, whose recorder-off blocks are the route's baseline.
memsnap processes: LD_PRELOAD=--lib, MEMSNAP_STACKS, MEMSNAP_CONTEXT (--memsnap-context; its
default alloc is memsnap's own; PyTorch's recorder runs with context="all"), MEMSNAP_FOLDER a
fresh folder per process, MEMSNAP_AT_EXIT=1, MEMSNAP_QUIET=1. Each memsnap process is also
measured against itself, as the recorder is: in its "pass" turns every thread's calls pass
through memsnap unrecorded (memsnap_debug_pass_through_every_thread, so --lib must be built
with --features bench-hooks), and the rows "on/off in process" pair its recording turns with
those. Those rows leave out what differs from one process to the next (10-40% on the lent
machines) and what memsnap costs while passing through (a few instructions a call: its
guard); the rows against the no-memsnap process keep both. The record of such a process
misses its passing-through steps by design: each step frees what it allocated, so its exit
snapshot still balances and still must say 0 dropped, 0 stackless.

Schedule: rounds. A round starts its processes together (they import torch, build the model
and do --warmup steps at the same time), then runs them in lock-step, one process at a time
while the others wait on a pipe. A turn is one settling step (not counted: the GPU and the
caches change hands) and --block timed steps. One cycle gives each measured configuration
(memsnap python and all in each route, the recorder with python and all stacks) a turn right
beside a turn of its baseline (the same route's no-memsnap process, recorder off), and each
memsnap process a recording turn beside a passing-through one: with every route and stack
mode, eight processes and 24 turns a cycle (--routes and --stacks leave the others out). The
order of the pairs rotates every cycle, and the baseline goes first in even cycles, second in
odd ones. --cycles cycles, then the processes exit and write their snapshots.
The step time of a shared virtual machine moves by tens of percent within a second (seen on an
H200 machine here: one process's 10-step blocks ranged from 11 to 20 ms): a configuration and
the baseline turn beside it, about 100 ms apart, see nearly the same machine; the rounds, each
with fresh processes, carry what differs from one process to the next. Before each round the driver estimates its length
from the rounds so far and starts it only if it ends within --budget-s; a round that reaches
the budget stops after the cycle in progress and keeps its complete cycles.

Checks (a configuration that fails one in any round prints VOID or ERROR instead of figures;
a memsnap process whose --lib lacks the pass-through switch is an ERROR):
every memsnap process's exit snapshot, read with benches/python/snapshot_counts.py, must exist
and say 0 dropped, 0 stackless and more than 0 events recorded, and its
memsnap.torch_allocator line must start with "blocks" in the default route (the tracker
attached: blocks recorded) and "tensors" in tensor mode; tensor-mode processes must run
PyTorch's cudaMallocAsync backend, default-route ones its native allocator. In the first round
the recorder is also switched on for one more step per stacks setting, with its history
cleared, and torch.cuda.memory._snapshot() must hold alloc entries with frames (with
stacks="python" some have none: those made on autograd's backward thread, which runs no
Python; with stacks="all" every one must have frames).

Statistics: per cycle, a configuration's block median over the block median of the baseline
turn beside it - 1; per round, the median over
its cycles; reported: the median over rounds, a bootstrap 95% interval of that median (10000
resamples of the rounds), min..max over rounds, and whether the interval is narrower than 1
percentage point (the pooled median over every cycle of every round is in the JSON). Step time:
the median over rounds of each process's median step. Goals: memsnap python <= 1%, memsnap all
<= 2% ("yes" when the whole interval is at or below the goal). Per event: the paired
step-time difference (block medians, same cycles) / events per step, where events per step are
the memsnap events recorded between two snapshots (memsnap_dump_path) taken right before the
first and after the last cycle of the first round, over the steps in between that recorded;
for the recorder, its trace entries in one step.

Output: OUT/step_time.json (settings, machine, clocksource, every block's step times, every
check, the summaries; rewritten after each round) and OUT/step_time.md, the Markdown table, also
printed on stdout; progress goes to stderr. Reading it: "overhead" is what users feel on this
step, with its interval; the per-process spread says how far processes of one configuration
differ (the pairing removes the drift they share, not that); "ns/event" turns the overhead
into a cost per allocator event, comparable with benches/gpu/hook_cost_torch.py and the cost
case of scripts/gpu/torch_blocks.py.
"""
import argparse
import atexit
import hashlib
import json
import math
import os
import pickle
import platform
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# This folder, the benchmarks' Python helpers (benches/python) and the helpers the GPU
# checks share with the benchmarks (scripts/gpu).
sys.path[:0] = [HERE, os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "..", "scripts", "gpu")]
from hook_cost_torch import ASYNC, SAFE_ENV, gpu_and_driver  # noqa: E402
from snapshot_counts import Tally, read_counts  # noqa: E402
from pinning import core_of, pin_main_thread  # noqa: E402
from transformer_step import PASS_SYMBOL, RECORDER_MAX_ENTRIES, TorchWorkload, add_workload_args  # noqa: E402

GOALS = {"python": 1.0, "all": 2.0}  # percent over the same route without memsnap
BOOTSTRAP = 10000

# The processes of one round: name, route, memsnap stacks (None: not loaded), whether it
# switches PyTorch's recorder.
CHILDREN = [
    ("tensor/no-memsnap", "tensor", None, False),
    ("tensor/memsnap-python", "tensor", "python", False),
    ("tensor/memsnap-all", "tensor", "all", False),
    ("default/no-memsnap", "default", None, True),
    ("default/memsnap-python", "default", "python", False),
    ("default/memsnap-all", "default", "all", False),
    ("tensor/memsnap-none", "tensor", "none", False),
    ("default/memsnap-none", "default", "none", False),
]
# The table's rows, one turn per cycle each: name, process, mode, kind, stacks, and the
# baseline's process and mode (None for a baseline). Modes: "off" (PyTorch's recorder off;
# memsnap, where loaded, recording), "python" / "all" (the recorder on with those stacks),
# "pass" (memsnap loaded but every thread's calls passing through it unrecorded).
ROWS = [
    ("tensor/no-memsnap", "tensor/no-memsnap", "off", "base", None, None, None),
    ("tensor/memsnap-python", "tensor/memsnap-python", "off", "memsnap", "python", "tensor/no-memsnap", "off"),
    ("tensor/memsnap-all", "tensor/memsnap-all", "off", "memsnap", "all", "tensor/no-memsnap", "off"),
    ("default/no-memsnap", "default/no-memsnap", "off", "base", None, None, None),
    ("default/memsnap-python", "default/memsnap-python", "off", "memsnap", "python", "default/no-memsnap", "off"),
    ("default/memsnap-all", "default/memsnap-all", "off", "memsnap", "all", "default/no-memsnap", "off"),
    ("default/torch-recorder-python", "default/no-memsnap", "python", "recorder", "python", "default/no-memsnap", "off"),
    ("default/torch-recorder-all", "default/no-memsnap", "all", "recorder", "all", "default/no-memsnap", "off"),
]
# Recording switched on and off inside each memsnap process, as the recorder is: the
# process-to-process spread (10-40% on the lent machines) leaves these rows. The processes
# without stacks have only these: what an event costs before any stack (the hook's floor).
ROWS += [(f"{proc}, on/off in process", proc, "off", "memsnap", stacks, proc, "pass")
         for proc, _, stacks, _ in CHILDREN if stacks]
RECORDER_CHILD = "default/no-memsnap"
ROUTES = ("tensor", "default")
STACKS = ("python", "all", "none")


def select_configurations(routes, stacks):
    """Keeps the processes and rows of `routes` and memsnap's `stacks` (--routes, --stacks):
    each route's process without memsnap stays (every row of the route is paired with it, and
    the default route's switches PyTorch's recorder), and the recorder's rows stay for the
    stacks kept. Fewer processes make shorter rounds: more rounds, so narrower intervals, in
    the same device time."""
    global CHILDREN, ROWS
    kept = {c[0] for c in CHILDREN if c[1] in routes and (c[2] is None or c[2] in stacks)}
    ROWS = [r for r in ROWS if r[1] in kept and (r[5] is None or r[5] in kept)
            and (r[3] != "recorder" or r[4] in stacks)]
    # A process without memsnap only where a row is measured against it (stacks "none" alone
    # has only its rows inside each process).
    used = {proc for r in ROWS if r[3] != "base" for proc in (r[1], r[5])}
    ROWS = [r for r in ROWS if r[1] in used]
    CHILDREN = [c for c in CHILDREN if c[0] in used]


def parse_choices(text, allowed, flag):
    """A comma-separated subset of `allowed`, in `allowed`'s order."""
    chosen = [c for c in text.split(",") if c]
    wrong = [c for c in chosen if c not in allowed]
    if wrong or not chosen:
        sys.exit(f"step_time.py: {flag} takes a comma-separated list of {', '.join(allowed)}, not {text!r}")
    return tuple(c for c in allowed if c in chosen)
# --dry-run: the fake step's overhead per configuration and recorder mode (fractions).
FAKE_COST = {"tensor/memsnap-none": 0.001, "default/memsnap-none": 0.001,
             "tensor/memsnap-python": 0.004, "tensor/memsnap-all": 0.010, "default/memsnap-python": 0.003,
             "default/memsnap-all": 0.008, "python": 0.04, "all": 0.10}
FAKE_EVENTS = {"tensor": 800, "default": 1200}


# ----------------------------------------------------------------------------------------------
# One process (child): the workload, run in turns the driver asks for on stdin


class FakeWorkload:
    """--dry-run: a busy-waiting step of --fake-step-ms (per-process offset 0.2%, per-step jitter
    1%, and a drift of +-8% over 7 s that every process shares, as a machine's speed drifts),
    slower by STEP_TIME_FAKE_COST and by the fake recorder's cost; with STEP_TIME_FAKE_EVENTS it
    writes memsnap-like snapshots (dumps and one at exit) into MEMSNAP_FOLDER."""

    def __init__(self, a):
        self.rng = random.Random(os.getpid() * 7919 + time.perf_counter_ns())
        self.base = a.fake_step_ms / 1e3 * (1 + self.rng.gauss(0, 0.002))
        self.cost = float(os.environ.get("STEP_TIME_FAKE_COST", "0"))
        self.rec_cost = 0.0
        self.passing = False
        self.i = self.recorded = 0
        self.events = int(os.environ.get("STEP_TIME_FAKE_EVENTS", "0"))
        self.async_ = ASYNC in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if self.events:
            atexit.register(self.dump, "exit")

    def info(self):
        return {"allocator_backend": "cudaMallocAsync" if self.async_ else "native", "torch": "none (dry run)",
                "cuda": None, "gpu": "none (dry run)", "python": platform.python_version(), "parameters": 0}

    def step(self):
        self.i += 1
        self.recorded += not self.passing
        drift = 1 + 0.08 * math.sin(2 * math.pi * time.time() / 7)
        noise = max(0.5, 1 + self.rng.gauss(0, 0.01))
        cost = 0.0 if self.passing else self.cost
        end = time.perf_counter() + self.base * (1 + cost + self.rec_cost) * drift * noise
        while time.perf_counter() < end:
            pass

    def allocations(self):
        return None if self.async_ else self.i * 400

    def dump(self, tag):
        if not self.events:
            return None
        meta = {"events_recorded": 50 + self.recorded * self.events, "events_without_stack": 0,
                "dropped_events": int(os.environ.get("STEP_TIME_FAKE_DROP", "0")),
                "stacks": os.environ.get("MEMSNAP_STACKS"),
                "torch_allocator": "tensors: dry run" if self.async_ else "blocks: dry run"}
        snap = {"segments": [], "memsnap": meta,
                "device_traces": [[{"action": "alloc", "frames": [{"filename": "fake.py", "line": 1, "name": "step"}]}]]}
        path = os.path.join(os.environ["MEMSNAP_FOLDER"], f"memsnap-fake-p{os.getpid()}-{tag}.pickle")
        with open(path, "wb") as f:
            pickle.dump(snap, f)
        return path

    def pass_through(self, on):
        self.passing = on

    def recorder(self, mode, clear=False):
        self.rec_cost = FAKE_COST[mode] if mode else 0.0

    def recorder_check(self, mode):
        self.recorder(mode)
        self.step()
        self.recorder(None)
        return {"entries_per_step": 1200, "allocs": 400, "allocs_without_frames": 0, "snapshot_s": 0.0}


def timed(wl):
    t0 = time.perf_counter()
    wl.step()
    return time.perf_counter() - t0


def reply(tag, obj):
    sys.stdout.write(f"{tag} {json.dumps(obj)}\n")
    sys.stdout.flush()


def child_main(a):
    """Builds the workload, warms up, says READY, then serves the driver's requests, one a line:
    RUN MODE N (MODE as in ROWS, one settling step, N timed steps), DUMP TAG (a memsnap
    snapshot now), CHECK (the recorder's check), EXIT. Each is answered by one DONE line of
    JSON. DUMP answers with the steps taken and those taken while memsnap passed through."""
    t0 = time.perf_counter()
    wl = FakeWorkload(a) if a.dry_run else TorchWorkload(a)
    info = wl.info()
    info["pid"] = os.getpid()
    if not a.dry_run and os.environ.get("LD_PRELOAD"):
        import ctypes

        info["pass_through"] = hasattr(ctypes.CDLL(None), PASS_SYMBOL)
    for _ in range(a.warmup):
        wl.step()
    info["setup_s"] = round(time.perf_counter() - t0, 2)  # build + warm-up
    info["pinned_cpu"], info["kept_off"] = (None, []) if a.no_pin else pin_main_thread(a.isolate)
    if info["pinned_cpu"] is not None and a.isolate:
        info["stepping_core"] = sorted(core_of(info["pinned_cpu"]))
    reply("READY", info)
    mode, passed = "off", 0

    def switch(to):
        if mode == "pass":
            wl.pass_through(False)
        elif mode != "off":
            wl.recorder(None)
        if to == "pass":
            wl.pass_through(True)
        elif to != "off":
            wl.recorder(to)
        return to

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "RUN":
            if cmd[1] != mode:
                mode = switch(cmd[1])
            n = int(cmd[2])
            passed += (1 + n) * (mode == "pass")
            settle = timed(wl)
            reply("DONE", {"settle_s": settle, "steps_s": [timed(wl) for _ in range(n)]})
        elif cmd[0] == "DUMP":
            mode = switch("off")
            reply("DONE", {"path": wl.dump(cmd[1]), "steps": wl.i, "steps_passed": passed,
                           "allocations": wl.allocations()})
        elif cmd[0] == "CHECK":
            mode = switch("off")
            reply("DONE", {m: wl.recorder_check(m) for m in ("python", "all")})
        elif cmd[0] == "EXIT":
            reply("DONE", {})
            return


class Child:
    """A child process of the driver's, with a line channel to it."""

    def __init__(self, name, route, stacks, argv, env, folder):
        self.name, self.route, self.stacks, self.folder = name, route, stacks, folder
        self.err = tempfile.TemporaryFile(mode="w+b")
        self.p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                  bufsize=0)
        self.buf = b""
        self.error = None

    def ask(self, line, timeout, tag="DONE"):
        """Sends line (unless None) and returns the JSON of the next `tag` line; raises
        RuntimeError when the process ends or does not answer in time."""
        if line is not None:
            try:
                self.p.stdin.write((line + "\n").encode())
            except OSError as e:
                raise RuntimeError(f"cannot write to the process: {e}{self.stderr_tail()}") from None
        end = time.time() + timeout
        while True:
            while b"\n" in self.buf:
                got, self.buf = self.buf.split(b"\n", 1)
                text = got.decode("utf-8", "replace")
                if text.startswith(tag + " "):
                    return json.loads(text[len(tag) + 1:])
            left = end - time.time()
            if left <= 0:
                raise RuntimeError(f"no {tag} within {timeout:.0f} s{self.stderr_tail()}")
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if ready:
                chunk = os.read(self.p.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise RuntimeError(f"exit {self.p.wait()} before {tag}{self.stderr_tail()}")
                self.buf += chunk

    def stderr_tail(self):
        self.err.seek(0)
        text = self.err.read().decode("utf-8", "replace").strip()
        return f": {text[-1500:]}" if text else ""

    def finish(self, timeout):
        """EXIT, then wait for the process (it writes its exit snapshot on the way out)."""
        try:
            if self.error is None:
                self.ask("EXIT", timeout)
            self.p.stdin.close()
            rc = self.p.wait(timeout=timeout)
            if rc != 0 and self.error is None:
                self.error = f"exit {rc}{self.stderr_tail()}"
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            self.error = self.error or f"{e}"
            self.p.kill()
            self.p.wait()


# ----------------------------------------------------------------------------------------------
# Statistics


def bootstrap_median_ci(values, reps=BOOTSTRAP, seed=20261126):
    """95% percentile-bootstrap interval of the median of values, or None for fewer than 3."""
    if len(values) < 3:
        return None
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(rng.choice(values) for _ in range(n)) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def interval(values):
    """Median, bootstrap interval, min and max of per-round values."""
    ci = bootstrap_median_ci(values)
    return {"n": len(values), "median": statistics.median(values), "ci": list(ci) if ci else None,
            "min": min(values), "max": max(values)}


def block_medians(rec, mode, pair):
    """{cycle: median step of that cycle's block} of one process's turns in one recorder mode
    for one pair."""
    return {b["cycle"]: statistics.median(b["steps_s"]) for b in rec.get("blocks", [])
            if b["mode"] == mode and b["pair"] == pair}


def row_check(name, proc, kind, stacks, runs):
    """None when every round of the row passed its checks, else the text printed instead."""
    recs = runs.get(proc, [])
    errors = [r for r in recs if r.get("error")]
    if errors:
        last = errors[0]["error"].strip().splitlines()
        return f"ERROR in {len(errors)} of {len(recs)} rounds: {(last[-1] if last else '?')[:160]}"
    if not recs:
        return "ERROR: never ran"
    if kind == "memsnap":
        tally, extra = Tally(), []
        want = "blocks" if name.startswith("default/") else "tensors"
        for r in recs:
            c = r.get("counts")
            tally.add(c)
            if c is None:
                continue
            if c["recorded"] <= 0:
                extra.append("0 events recorded")
            if not c.get("torch_allocator", "").startswith(want):
                extra.append(f"torch_allocator {c.get('torch_allocator', '')[:60]!r}, not {want}")
        verdict = tally.verdict()
        if verdict or extra:
            return (verdict or "VOID") + (f" ({'; '.join(sorted(set(extra)))})" if extra else "")
    if kind == "recorder":
        checks = [r["recorder_check"][stacks] for r in recs if "recorder_check" in r]
        if not checks:
            return "VOID (recorder not checked)"
        for c in checks:
            with_frames = c["allocs"] - c["allocs_without_frames"]
            if c["allocs"] <= 0 or with_frames <= 0 or (stacks == "all" and c["allocs_without_frames"]):
                return (f"VOID (recorder kept {c['allocs']} alloc entries, {c['allocs_without_frames']} "
                        f"without frames)")
    return None


def summarize(runs):
    """Per row: step time, spread over processes, paired overhead, events and cost per event."""
    rounds = sorted({r["round"] for recs in runs.values() for r in recs})
    ok = {(proc, r["round"]): r for proc, recs in runs.items() for r in recs if not r.get("error")}
    out = {}
    for name, proc, mode, kind, stacks, base, base_mode in ROWS:
        row = {"process": proc, "mode": mode, "kind": kind, "stacks": stacks, "baseline": [base, base_mode],
               "check": row_check(name, proc, kind, stacks, runs)}
        procs = [ok[(proc, r)]["mode_median_s"][mode] for r in rounds
                 if (proc, r) in ok and mode in ok[(proc, r)].get("mode_median_s", {})]
        if procs:
            med = statistics.median(procs)
            row.update(step_s=med, processes=len(procs), process_medians_s=procs,
                       process_spread_pct=(max(procs) - min(procs)) / med * 100)
        if kind != "base":
            ratios, deltas, pooled, cycles = [], [], [], 0
            for r in rounds:
                if (proc, r) not in ok or (base, r) not in ok:
                    continue
                mine, theirs = block_medians(ok[(proc, r)], mode, name), block_medians(ok[(base, r)], base_mode, name)
                both = sorted(set(mine) & set(theirs))
                if not both:
                    continue
                per_cycle = [mine[c] / theirs[c] - 1 for c in both]
                pooled += per_cycle
                cycles += len(both)
                ratios.append(statistics.median(per_cycle))
                deltas.append(statistics.median(mine[c] - theirs[c] for c in both))
            if ratios:
                row["overhead"] = interval(ratios)
                row["delta_s"] = interval(deltas)
                row["pooled"] = {"cycles": cycles, "median": statistics.median(pooled),
                                 "quartiles": statistics.quantiles(pooled, n=4) if len(pooled) > 1 else None}
        if kind == "memsnap":
            per_step = [r["events_per_step"] for r in runs.get(proc, []) if r.get("events_per_step")]
            row["events_per_step"] = statistics.median(per_step) if per_step else None
        elif kind == "recorder":
            per_step = [r["recorder_check"][stacks]["entries_per_step"] for r in runs.get(proc, [])
                        if "recorder_check" in r]
            row["events_per_step"] = statistics.median(per_step) if per_step else None
        blocks = [r["allocator_blocks_per_step"] for r in runs.get(proc, []) if r.get("allocator_blocks_per_step")]
        row["allocator_blocks_per_step"] = statistics.median(blocks) if blocks else None
        if row.get("events_per_step") and "delta_s" in row:
            d, e = row["delta_s"], row["events_per_step"]
            row["ns_per_event"] = {"median": d["median"] / e * 1e9,
                                   "ci": [d["ci"][0] / e * 1e9, d["ci"][1] / e * 1e9] if d["ci"] else None}
        if kind == "memsnap" and "overhead" in row and stacks in GOALS:
            o, goal = row["overhead"], GOALS[stacks]
            hi = o["ci"][1] * 100 if o["ci"] else o["max"] * 100
            row["goal_pct"] = goal
            row["goal_met"] = "yes" if hi <= goal else ("median only" if o["median"] * 100 <= goal else "no")
        out[name] = row
    return out


# ----------------------------------------------------------------------------------------------
# Driver


def child_env(a, name, route, stacks, folder):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMSNAP_", "LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF", "STEP_TIME_"))}
    env.update(SAFE_ENV)
    if route == "tensor":
        env["PYTORCH_CUDA_ALLOC_CONF"] = ASYNC
    if stacks:
        env.update(MEMSNAP_STACKS=stacks, MEMSNAP_CONTEXT=a.memsnap_context, MEMSNAP_FOLDER=folder,
                   MEMSNAP_AT_EXIT="1", MEMSNAP_QUIET="1")
        if a.dry_run:
            env["STEP_TIME_FAKE_EVENTS"] = str(FAKE_EVENTS[route])
        else:
            env["LD_PRELOAD"] = os.path.abspath(a.lib)
    if a.dry_run:
        env["STEP_TIME_FAKE_COST"] = str(FAKE_COST.get(name, 0.0))
        if name in a.dry_run_lose:
            env["STEP_TIME_FAKE_DROP"] = "3"
    return env


def child_argv(a):
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--warmup", str(a.warmup), "--dtype", a.dtype,
            "--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads), "--batch",
            str(a.batch), "--seq", str(a.seq), "--vocab", str(a.vocab), "--fake-step-ms", str(a.fake_step_ms)]
    for flag, on in (("--dry-run", a.dry_run), ("--no-pin", a.no_pin), ("--isolate", a.isolate)):
        if on:
            argv.append(flag)
    return argv


def snapshot_meta(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    return snap.get("memsnap", {}) if isinstance(snap, dict) else {}


def cycle_turns(cycle):
    """[(process, mode, pair)]: each configuration's turn beside a turn of its
    baseline (pair: the configuration's name); the order of the pairs rotates every cycle, and
    within each pair the baseline goes first in even cycles, second in odd ones."""
    pairs = [(name, proc, mode, base, base_mode) for name, proc, mode, kind, _, base, base_mode in ROWS
             if kind != "base"]
    k = cycle % len(pairs)
    turns = []
    for name, proc, mode, base, base_mode in pairs[k:] + pairs[:k]:
        two = [(base, base_mode, name), (proc, mode, name)]
        turns += two if cycle % 2 == 0 else two[::-1]
    return turns


def log(text):
    print(text, file=sys.stderr, flush=True)


def run_round(a, rnd, t_start, estimate_cycle_s):
    """One round: the processes, their cycles, their checks. Returns {process name: record}."""
    first = rnd == 0
    kids, recs = {}, {}
    t0 = time.time()
    for name, route, stacks, _ in CHILDREN:
        folder = tempfile.mkdtemp(prefix="step-time.")
        kids[name] = Child(name, route, stacks, child_argv(a), child_env(a, name, route, stacks, folder), folder)
        recs[name] = {"round": rnd, "blocks": []}
    try:
        for name, kid in kids.items():
            try:
                recs[name].update(kid.ask(None, a.child_timeout, tag="READY"))
                want = "cudaMallocAsync" if kid.route == "tensor" else "native"
                if recs[name].get("allocator_backend") != want:
                    kid.error = f"allocator backend {recs[name].get('allocator_backend')!r}, not {want}"
                elif recs[name].get("pass_through") is False:
                    kid.error = f"--lib has no {PASS_SYMBOL}: build it with --features bench-hooks"
            except RuntimeError as e:
                kid.error = str(e)
        ready_s = time.time() - t0
        live = [k for k in kids.values() if k.error is None]
        dumps = {}
        if first:
            for kid in live:
                try:
                    dumps[kid.name] = [kid.ask("DUMP timed-start", a.child_timeout)]
                except RuntimeError as e:
                    kid.error = str(e)
        t_cycles, cycles = time.time(), 0
        for cycle in range(a.cycles):
            # Stop before a cycle that would end past the budget, less what the processes' exit
            # and the checks take (a safety net: rounds start only where their estimate fits).
            per_cycle = (time.time() - t_cycles) / cycles if cycles else estimate_cycle_s
            if cycles and time.time() - t_start + per_cycle + min(10, 0.05 * a.budget_s) > a.budget_s:
                log(f"round {rnd + 1}: budget reached after {cycles} cycles")
                break
            for proc, mode, pair in cycle_turns(cycle):
                kid = kids[proc]
                if kid.error is not None:
                    continue
                try:
                    got = kid.ask(f"RUN {mode} {a.block}", a.child_timeout)
                    recs[proc]["blocks"].append({"cycle": cycle, "mode": mode, "pair": pair, **got})
                except RuntimeError as e:
                    kid.error = str(e)
            cycles += 1
        cycle_s = (time.time() - t_cycles) / max(1, cycles)
        if first:
            for kid in kids.values():
                if kid.error is None and kid.name in dumps:
                    try:
                        dumps[kid.name].append(kid.ask("DUMP timed-end", a.child_timeout))
                    except RuntimeError as e:
                        kid.error = str(e)
            kid = kids.get(RECORDER_CHILD)
            if kid is not None and kid.error is None:
                try:
                    recs[RECORDER_CHILD]["recorder_check"] = kid.ask("CHECK", a.child_timeout)
                except RuntimeError as e:
                    kid.error = str(e)
    finally:
        for kid in kids.values():
            kid.finish(60)
    for name, kid in kids.items():
        rec = recs[name]
        rec.update(cycles=cycles, ready_s=round(ready_s, 1), cycle_s=round(cycle_s, 3))
        if first and len(dumps.get(name, [])) == 2:
            start, end = dumps[name]
            steps = end["steps"] - start["steps"]
            recorded = steps - (end["steps_passed"] - start["steps_passed"])
            if start["allocations"] is not None and end["allocations"] is not None:
                rec["allocator_blocks_per_step"] = (end["allocations"] - start["allocations"]) / steps
            if kid.stacks:
                if start["path"] and end["path"]:
                    before, after = snapshot_meta(start["path"]), snapshot_meta(end["path"])
                    rec["events_per_step"] = (after["events_recorded"] - before["events_recorded"]) / recorded
                elif kid.error is None:
                    kid.error = "no snapshot from memsnap_dump_path around the cycles"
                for d in (start, end):  # the exit snapshot must be the one left in the folder
                    if d["path"] and os.path.exists(d["path"]):
                        os.unlink(d["path"])
        if kid.stacks:
            rec["counts"] = read_counts(kid.folder)
            if rec["counts"]:
                rec["counts"].pop("file", None)
        shutil.rmtree(kid.folder, ignore_errors=True)
        if kid.error is not None:
            rec["error"] = kid.error
        by_mode = {}
        for b in rec["blocks"]:
            by_mode.setdefault(b["mode"], []).extend(b["steps_s"])
        rec["mode_median_s"] = {m: statistics.median(v) for m, v in by_mode.items()}
    return recs, cycle_s


def machine(a):
    out = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        with open("/sys/devices/system/clocksource/clocksource0/current_clocksource") as f:
            out["clocksource"] = f.read().strip()
    except OSError:
        out["clocksource"] = None
    found = gpu_and_driver()
    if found:
        out.update(gpu=found[0], driver=found[1])
    if not a.dry_run:
        with open(a.lib, "rb") as f:
            out["lib"] = {"path": a.lib, "bytes": os.path.getsize(a.lib), "sha256": hashlib.sha256(f.read()).hexdigest()}
    if a.cli:
        try:
            v = subprocess.run([a.cli, "--version"], capture_output=True, text=True, timeout=20)
            out["cli_version"] = v.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            out["cli_version"] = None
    return out


def pct(x, digits=2):
    return f"{x * 100:+.{digits}f}"


def table(doc):
    s, m, rows = doc["settings"], doc["machine"], doc["rows"]
    any_run = next((r for recs in doc["runs"].values() for r in recs if not r.get("error")), {})
    workload = (f"fake step of {s['fake_step_ms']} ms (dry run)" if s["dry_run"] else
                f"TransformerEncoder LM {s['layers']} x d{s['d_model']}, {s['heads']} heads, FF {4 * s['d_model']}, "
                f"vocab {s['vocab']}, batch {s['batch']} x seq {s['seq']}, AdamW, {s['dtype']}"
                f"{' autocast' if s['dtype'] == 'bf16' else ''}, {any_run.get('parameters', '?')} parameters")
    cycles = [r["cycles"] for r in doc["runs"].get(CHILDREN[0][0], [])]
    lines = [
        f"command: `{doc['command']}`",
        f"date: {doc['date']}  GPU: {m.get('gpu') or any_run.get('gpu', '?')}"
        f"{', driver ' + m['driver'] if m.get('driver') else ''}; torch {any_run.get('torch', '?')}, "
        f"CUDA {any_run.get('cuda', '?')}, Python {m['python']}; {m['cpus']} CPUs, clocksource {m['clocksource']}",
        f"workload: {workload}; {s['warmup']} warm-up steps per process, then cycles of {len(cycle_turns(0))} turns "
        f"(each configuration beside its baseline), a turn 1 settling + {s['block']} timed steps; memsnap MEMSNAP_CONTEXT={s['memsnap_context']}, PyTorch's "
        f"recorder context='all', max_entries={RECORDER_MAX_ENTRIES}",
        f"rounds: {doc['rounds_run']} ({doc['stop_reason']}), cycles per round: "
        f"{', '.join(str(c) for c in cycles) or '—'}; took {doc['elapsed_s']:.0f} s of a {s['budget_s']:.0f} s budget",
        "",
        "| configuration | step ms | per-process medians ms (spread) | overhead % | 95% interval % (width) "
        "| min..max % | goal | events/step | ns/event | check |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, *_ in ROWS:
        row = rows[name]
        if row["check"]:
            lines.append(f"| {name} | {row['check']} | | | | | | | | {row['check'].split(' ')[0]} |")
            continue
        procs = row.get("process_medians_s") or []
        step = f"{row['step_s'] * 1e3:.3f}" if procs else "—"
        spread = (f"{min(procs) * 1e3:.3f}..{max(procs) * 1e3:.3f} ({row['process_spread_pct']:.1f}%)"
                  if procs else "—")
        o = row.get("overhead")
        if o:
            over = pct(o["median"])
            if o["ci"]:
                width = (o["ci"][1] - o["ci"][0]) * 100
                ci = f"{pct(o['ci'][0])}..{pct(o['ci'][1])} ({width:.2f} pt, {'<' if width < 1 else '>='} 1)"
            else:
                ci = f"— ({o['n']} round{'s' if o['n'] != 1 else ''}: no interval)"
            span = f"{pct(o['min'])}..{pct(o['max'])}"
        else:
            over = ci = span = "—"
        goal = f"<= {row['goal_pct']:g}%: {row['goal_met']}" if "goal_met" in row else "—"
        eps = f"{row['events_per_step']:.0f}" if row.get("events_per_step") else "—"
        ns = row.get("ns_per_event")
        ns_txt = "—"
        if ns:
            ns_txt = f"{ns['median']:.0f}" + (f" ({ns['ci'][0]:.0f}..{ns['ci'][1]:.0f})" if ns["ci"] else "")
        lines.append(f"| {name} | {step} | {spread} | {over} | {ci} | {span} | {goal} | {eps} | {ns_txt} | OK |")
    blocks = {proc: rows[n]["allocator_blocks_per_step"] for n, proc, *_ in ROWS
              if rows[n].get("allocator_blocks_per_step")}
    lines += [
        "",
        "step ms: median over rounds of each process's median step (in that row's mode). overhead: per cycle, block "
        "median / the block median of the baseline turn beside it - 1 (the baseline: the same route without memsnap, "
        "recorder off; for the rows \"on/off in process\", the same process with every thread's calls passing "
        "through memsnap unrecorded); per round the median over cycles; "
        "shown: the median over rounds, a bootstrap 95% interval of it, min..max over rounds. events/step: memsnap "
        "events recorded per step (first round, snapshots before and after the cycles); recorder rows: its trace "
        "entries in one step. ns/event: paired step-time difference / events per step.",
    ]
    if blocks:
        lines.append("Blocks the caching allocator handed out per step (torch.cuda.memory_stats): "
                     + ", ".join(f"{n} {v:.0f}" for n, v in blocks.items()) + ".")
    if any_run.get("pinned_cpu") is not None:
        lines.append(f"Every process's stepping thread ran pinned to CPU {any_run['pinned_cpu']} after its warm-up.")
        kept = sorted({name for runs in doc["runs"].values() for r in runs for name in r.get("kept_off", [])})
        if kept:
            core = any_run.get("stepping_core") or [any_run["pinned_cpu"]]
            lines.append(f"Every other thread of each process was kept off that core (CPUs "
                         f"{', '.join(map(str, core))}; --isolate): " + ", ".join(kept) + ".")
    errors = [(n, r) for n, recs in doc["runs"].items() for r in recs if r.get("error")]
    if errors:
        lines += ["", "Errors:"] + [f"- {n}, round {r['round'] + 1}: {r['error'].strip().splitlines()[-1][:300]}"
                                     for n, r in errors[:12]]
    return "\n".join(lines)


def write(doc, out):
    doc["rows"] = summarize(doc["runs"])
    with open(os.path.join(out, "step_time.json"), "w") as f:
        json.dump(doc, f, indent=1)


def merge(a, argv):
    """--merge: the rounds of several runs' step_time.json as one (renumbered in order)."""
    docs = []
    for path in a.merge:
        with open(path) as f:
            docs.append(json.load(f))
    # (Runs from before --routes and --stacks had every process.)
    chosen = {(tuple(d["settings"].get("routes", ROUTES)), tuple(d["settings"].get("stacks", STACKS)))
              for d in docs}
    if len(chosen) != 1:
        sys.exit("step_time.py --merge: the runs were made with different --routes or --stacks")
    select_configurations(*chosen.pop())
    doc = docs[0]
    doc["command"] = "python3 " + " ".join([os.path.relpath(argv[0])] + argv[1:])
    doc["merged"] = [{"command": d["command"], "date": d["date"], "rounds_run": d["rounds_run"],
                      "gpu": d["machine"].get("gpu")} for d in docs]
    runs, offset = {name: [] for name, *_ in CHILDREN}, 0
    for d in docs:
        for name, recs in d["runs"].items():
            runs[name] += [dict(r, round=r["round"] + offset) for r in recs]
        offset += d["rounds_run"]
    doc.update(runs=runs, rounds_run=offset, elapsed_s=sum(d["elapsed_s"] for d in docs),
               stop_reason=f"{len(docs)} runs merged")
    doc["settings"]["budget_s"] = sum(d["settings"]["budget_s"] for d in docs)
    os.makedirs(a.out, exist_ok=True)
    write(doc, a.out)
    text = table(doc)
    with open(os.path.join(a.out, "step_time.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def drive(a, argv):
    if not a.dry_run and not os.path.exists(a.lib):
        sys.exit(f"step_time.py: {a.lib} not found")
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    doc = {"command": "python3 " + " ".join([os.path.relpath(argv[0])] + argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           "settings": {k: v for k, v in vars(a).items() if k not in ("child", "out")},
           "machine": machine(a), "runs": {name: [] for name, *_ in CHILDREN},
           "rounds_run": 0, "round_seconds": [], "stop_reason": f"--max-rounds {a.max_rounds}", "elapsed_s": 0}
    cycle_s = None
    for rnd in range(a.max_rounds):
        elapsed = time.time() - t_start
        secs = doc["round_seconds"]
        if secs:
            # The first round also dumps and checks: later rounds are estimated from later ones.
            estimate = max(secs[1:]) if len(secs) > 1 else secs[0]
            if elapsed + estimate > a.budget_s:
                doc["stop_reason"] = f"budget: round {rnd + 1} would end near {elapsed + estimate:.0f} s"
                break
        t_round = time.time()
        recs, cycle_s = run_round(a, rnd, t_start, cycle_s or 0.0)
        for name, rec in recs.items():
            doc["runs"][name].append(rec)
            med = rec["mode_median_s"].get("off")
            log(f"round {rnd + 1} {name}: {rec['cycles']} cycles, median step "
                f"{'—' if med is None else f'{med * 1e3:.3f} ms'}" + (f"; ERROR {rec['error'][:300]}" if 'error' in rec else ""))
        doc["rounds_run"] = rnd + 1
        secs.append(round(time.time() - t_round, 1))
        doc["elapsed_s"] = time.time() - t_start
        write(doc, a.out)
    doc["elapsed_s"] = time.time() - t_start
    write(doc, a.out)
    text = table(doc)
    with open(os.path.join(a.out, "step_time.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", help="libmemsnap.so to preload (not needed with --dry-run)")
    p.add_argument("--cli", help="the memsnap CLI (only its --version is recorded)")
    p.add_argument("--out", default=".", help="folder for step_time.json and step_time.md")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no round, and no cycle, that would end later than this (520; dry run 12)")
    p.add_argument("--max-rounds", type=int, default=1000)
    p.add_argument("--cycles", type=int, default=None, help="cycles per round (60; dry run 8)")
    p.add_argument("--block", type=int, default=None, help="timed steps per turn (5; dry run 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per process before the cycles (30; dry run 5)")
    p.add_argument("--child-timeout", type=float, default=180, help="seconds a process may take to start or answer")
    p.add_argument("--memsnap-context", choices=["alloc", "all"], default="alloc")
    p.add_argument("--routes", default=",".join(ROUTES),
                   help="the routes measured, comma-separated: tensor, default (both); the recorder runs in default")
    p.add_argument("--stacks", default=",".join(STACKS),
                   help="memsnap's stack modes measured, comma-separated: python, all, none (all three)")
    add_workload_args(p)
    p.add_argument("--no-pin", action="store_true", help="leave the stepping threads unpinned")
    p.add_argument("--isolate", action="store_true",
                   help="also keep every other thread of each process (memsnap's writer, PyTorch's) off the "
                        "stepping thread's core (its SMT siblings included)")
    p.add_argument("--dry-run", action="store_true", help="fake workload: no torch, no GPU, no preload")
    p.add_argument("--dry-run-lose", action="append", default=[], metavar="CONFIG",
                   help="dry run: this configuration's fake snapshots report dropped events (shows VOID)")
    p.add_argument("--fake-step-ms", type=float, default=2.0)
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge these runs' step_time.json (no measuring)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a process of the driver's
    a = p.parse_args(argv[1:])
    for key, real, dry in (("warmup", 30, 5), ("cycles", 60, 8), ("block", 5, 10), ("budget_s", 520, 12)):
        if getattr(a, key) is None:
            setattr(a, key, dry if a.dry_run else real)
    if a.child:
        child_main(a)
        return
    a.routes = parse_choices(a.routes, ROUTES, "--routes")
    a.stacks = parse_choices(a.stacks, STACKS, "--stacks")
    if a.merge:
        merge(a, argv)
        return
    if not a.dry_run and not a.lib:
        p.error("--lib is required (or --dry-run)")
    select_configurations(a.routes, a.stacks)
    drive(a, argv)


if __name__ == "__main__":
    main(sys.argv)
