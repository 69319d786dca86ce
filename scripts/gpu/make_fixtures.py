#!/usr/bin/env python3
"""Remakes the six PyTorch reference snapshots of tests/fixtures/torch (needs a CUDA GPU and torch).

    python3 scripts/gpu/make_fixtures.py OUTDIR          (from the repository root, exactly so)
    python3 scripts/gpu/make_fixtures.py --manifest DIR  (no GPU, no torch: recount DIR's
                                                          files, rewrite DIR/fixtures.json)

Writes into OUTDIR the six .pickle files, fixtures.json (what Python's pickle.load finds in
each file; the tests read their expected counts from it) and table.md (the table of
tests/fixtures/torch/README.md). Copy all of them into tests/fixtures/torch/.

Every workload runs in a fresh Python process of its own, seeded, made by PyTorch's own
recorder (torch.cuda.memory._record_memory_history + _dump_snapshot).

Frames name this script `scripts/gpu/make_fixtures.py`, never a path of the machine: Python
(3.9 and later) gives the script it runs an absolute file name, so each workload process
compiles this file itself under its repository-relative name and runs it from there. That
name is only right when the current folder is the repository root, which is why the script
refuses any other invocation. Every Python stack in the files therefore starts with
`<string>:1 (<module>)` (that one-line bootstrap), then `child`, then the workload function.

The lines that tests look for end in a `# FIXTURE-ANCHOR: <name>` comment; the tests find
the line number by reading this file, so lines may move. Rename an anchor only together
with the tests that use it (tests/cli.rs, crates/format/src/pickle_read/fixtures.rs).
"""

import json
import os
import pickle
import re
import subprocess
import sys

REL = "scripts/gpu/make_fixtures.py"
ANCHOR = re.compile(r"# FIXTURE-ANCHOR: ([a-z0-9][a-z0-9 ]*[a-z0-9])$")
CHILD_TIMEOUT_S = 300
# Runs one workload: this file compiled under its relative name (argv: REL, mode, outdir).
BOOT = (
    "import sys; g = {'__name__': 'make_fixtures'}; "
    "exec(compile(open(sys.argv[1]).read(), sys.argv[1], 'exec'), g); "
    "g['child'](sys.argv[2], sys.argv[3])"
)

torch = None  # imported by child(): the parent never needs torch


def save(outdir, name):
    torch.cuda.memory._dump_snapshot(os.path.join(outdir, name))


def fixture_python(outdir):
    """MLP + Adam, 4 steps, stacks="python"."""
    torch.cuda.memory._record_memory_history(max_entries=3000, stacks="python", context="all")
    lin = torch.nn.Linear
    m = torch.nn.Sequential(lin(1024, 4096), torch.nn.ReLU(), lin(4096, 1024)).cuda()  # FIXTURE-ANCHOR: mlp model
    opt = torch.optim.Adam(m.parameters())
    for _ in range(4):
        m(torch.randn(256, 1024, device="cuda")).sum().backward()  # FIXTURE-ANCHOR: mlp forward and backward
        opt.step()  # FIXTURE-ANCHOR: mlp optimizer step
        opt.zero_grad()
    save(outdir, "torch-python-stacks.pickle")


def fixture_expandable(outdir):
    """Expandable segments (run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True):
    four tensors map into growing segments, one is freed and empty_cache() unmaps it."""
    torch.cuda.memory._record_memory_history(max_entries=3000, stacks="python")
    xs = []
    for n in (30, 70, 150, 20):
        xs.append(torch.empty(n * 2**20, dtype=torch.uint8, device="cuda"))  # FIXTURE-ANCHOR: expandable alloc
    del xs[1]
    torch.cuda.empty_cache()
    save(outdir, "torch-expandable-segments.pickle")


def fixture_oom(outdir):
    """16 GiB tensors until the device runs out: the last event is an `oom`."""
    torch.cuda.memory._record_memory_history(max_entries=2000, stacks="python")
    keep = []
    try:
        while True:
            keep.append(torch.empty(16 * 2**30, dtype=torch.uint8, device="cuda"))  # FIXTURE-ANCHOR: oom alloc
    except torch.cuda.OutOfMemoryError:
        save(outdir, "torch-oom.pickle")


def fixture_leak(outdir):
    """A real leak: every step's loss stays referenced. Saved after step 3 and step 11."""
    torch.cuda.memory._record_memory_history(max_entries=4000, stacks="python")
    lin = torch.nn.Linear
    model = torch.nn.Sequential(lin(512, 2048), torch.nn.GELU(), lin(2048, 512)).cuda()  # FIXTURE-ANCHOR: leak model
    opt = torch.optim.AdamW(model.parameters())
    hist = []
    for step in range(12):
        loss = model(torch.randn(64, 512, device="cuda")).pow(2).mean()  # FIXTURE-ANCHOR: leak loss
        hist.append(loss)  # the leak: one more scalar loss alive per step
        loss.backward()
        opt.step()  # FIXTURE-ANCHOR: leak optimizer step
        opt.zero_grad()
        if step == 3:
            save(outdir, "torch-leak-step3.pickle")
    save(outdir, "torch-leak-step11.pickle")


def fixture_transformer(outdir):
    """6-layer TransformerEncoder + Adam, 8 steps, stacks="all", context="all".

    Recording starts after the model and optimizer exist, so the history starts with the
    parameters already live (their blocks have no frames). The last step's `x` and `out`
    are still referenced at the dump, so the forward line holds live memory at the end."""
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False).cuda()
    opt = torch.optim.Adam(model.parameters())
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="all", context="all")
    for _ in range(8):
        x = torch.randn(32, 128, 512, device="cuda")  # FIXTURE-ANCHOR: transformer input
        out = model(x)  # FIXTURE-ANCHOR: transformer forward
        out.pow(2).mean().backward()
        opt.step()  # FIXTURE-ANCHOR: transformer optimizer step
        opt.zero_grad()
    save(outdir, "torch-transformer-all-stacks.pickle")


# mode: (function, files it writes, PYTORCH_CUDA_ALLOC_CONF it needs), in the order they run.
MODES = {
    "python": (fixture_python, ["torch-python-stacks.pickle"], None),
    "expandable": (fixture_expandable, ["torch-expandable-segments.pickle"], "expandable_segments:True"),
    "oom": (fixture_oom, ["torch-oom.pickle"], None),
    "leak": (fixture_leak, ["torch-leak-step3.pickle", "torch-leak-step11.pickle"], None),
    "transformer": (fixture_transformer, ["torch-transformer-all-stacks.pickle"], None),
}
FILES = [f for _, files, _ in MODES.values() for f in files]


def child(mode, outdir):
    """One workload, in a process of its own (started by run_workloads through BOOT)."""
    global torch
    fn, _, conf = MODES[mode]
    # The allocator reads its configuration once, when torch starts using CUDA.
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") != conf:
        sys.exit(f"make_fixtures {mode}: PYTORCH_CUDA_ALLOC_CONF must be {conf!r}, "
                 f"is {os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}")
    import torch
    if not torch.cuda.is_available():
        sys.exit("make_fixtures: no CUDA device")
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    torch.backends.cudnn.benchmark = False
    fn(outdir)


def anchors(source):
    """{anchor name: (line, function)} from the FIXTURE-ANCHOR comments of `source`."""
    found, func = {}, "<module>"
    for n, line in enumerate(source.splitlines(), 1):
        m = re.match(r"def (\w+)\(", line)
        if m:
            func = m.group(1)
        m = ANCHOR.search(line)
        if m and not line.lstrip().startswith("#"):
            name = m.group(1)
            if name in found:
                raise SystemExit(f"{REL}:{n}: anchor {name!r} appears twice")
            found[name] = (n, func)
    return found


def check_invocation():
    """Frames must read `scripts/gpu/make_fixtures.py`: run from the repository root only."""
    arg0 = sys.argv[0]
    here = os.getcwd()
    problem = None
    if os.path.isabs(arg0):
        problem = f"it was started by its absolute path {arg0!r}"
    elif os.path.normpath(arg0) != REL:
        problem = f"it was started as {arg0!r}, not as {REL!r}"
    elif not (os.path.isfile("Cargo.toml") and os.path.isdir("tests/fixtures/torch")):
        problem = f"the current folder {here!r} is not the memsnap repository root"
    if problem:
        sys.exit(
            f"make_fixtures.py: refusing to run: {problem}.\n"
            f"The fixtures' frames carry this script's file name, so it must be run from the "
            f"repository root as\n    python3 {REL} OUTDIR\n"
            f"(anything else would put this machine's paths into the fixtures)."
        )


def torch_environment():
    code = (
        "import json, platform, torch; "
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'python': platform.python_version(), "
        "'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        sys.exit(f"make_fixtures: python3 cannot import torch:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_workloads(outdir, modes):
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for mode in modes:
        _, files, conf = MODES[mode]
        e = dict(env)
        if conf is not None:
            e["PYTORCH_CUDA_ALLOC_CONF"] = conf
        print(f"== {mode}: {', '.join(files)}" + (f"  (PYTORCH_CUDA_ALLOC_CONF={conf})" if conf else ""),
              flush=True)
        r = subprocess.run([sys.executable, "-c", BOOT, REL, mode, outdir], env=e,
                           timeout=CHILD_TIMEOUT_S)
        if r.returncode != 0:
            sys.exit(f"make_fixtures: workload {mode!r} failed (exit {r.returncode})")
        for f in files:
            if not os.path.isfile(os.path.join(outdir, f)):
                sys.exit(f"make_fixtures: workload {mode!r} did not write {f}")


def frames_of(snap):
    for seg in snap.get("segments", []):
        for b in seg.get("blocks", []):
            yield from b.get("frames", []) or []
    for trace in snap.get("device_traces", []):
        for e in trace:
            yield from e.get("frames", []) or []


def count_file(path, marks):
    """What Python's pickle finds in one snapshot (the numbers the tests compare with)."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    actions = {}
    for trace in snap["device_traces"]:
        for e in trace:
            actions[e["action"]] = actions.get(e["action"], 0) + 1
    blocks = [b for s in snap["segments"] for b in s["blocks"]]
    live = [b for b in blocks if b["state"] == "active_allocated"]
    ooms = [
        {"device": d, "event": i, "size": e["size"], "device_free": e.get("device_free")}
        for d, trace in enumerate(snap["device_traces"])
        for i, e in enumerate(trace)
        if e["action"] == "oom"
    ]
    at_line = {(n, func): name for name, (n, func) in marks.items()}
    seen, script_names, machine = set(), set(), set()
    for fr in frames_of(snap):
        fn = fr.get("filename", "")
        if fn == REL:
            name = at_line.get((fr.get("line"), fr.get("name")))
            if name:
                seen.add(name)
        elif fn.endswith("make_fixtures.py"):
            script_names.add(fn)
        if re.match(r"/(work|root|home)/", fn):
            machine.add(fn)
    return {
        "bytes": os.path.getsize(path),
        "devices": len(snap["device_traces"]),
        "events": [len(t) for t in snap["device_traces"]],
        "actions": dict(sorted(actions.items())),
        "segments": len(snap["segments"]),
        "expandable_segments": sum(1 for s in snap["segments"] if s.get("is_expandable")),
        "reserved_bytes": sum(s["total_size"] for s in snap["segments"]),
        "live_bytes": sum(b["size"] for b in live),
        "live_requested_bytes": sum(b["requested_size"] for b in live),
        "live_blocks": len(live),
        "ooms": ooms,
        "anchors": sorted(seen, key=lambda a: marks[a][0]),
        "_script_names": sorted(script_names),
        "_machine_paths": sorted(machine),
    }


def size_text(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def table(files, marks):
    rows = [
        "| file | events (device 0) | actions | segments | live at the end | frames to look for |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in files.items():
        acts = ", ".join(f"{k} {v}" for k, v in c["actions"].items())
        for o in c["ooms"]:
            acts += f" (oom at event {o['event']}, device_free {size_text(o['device_free'] or 0)})"
        look = "<br>".join(f"`{REL}:{marks[a][0]}` ({a})" for a in c["anchors"]) or "none"
        live = f"{size_text(c['live_bytes'])} in {c['live_blocks']} blocks"
        rows.append(
            f"| {name} ({size_text(c['bytes'])}) | {c['events'][0] if c['events'] else 0} | {acts} "
            f"| {c['segments']} | {live} | {look} |"
        )
    return "\n".join(rows) + "\n"


def manifest(outdir, made_with, strict):
    """Counts every fixture in outdir, writes fixtures.json there, returns the README table."""
    with open(REL) as f:
        marks = anchors(f.read())
    by_func = {}
    for name, (_, func) in marks.items():
        by_func.setdefault(func, []).append(name)
    files, problems = {}, []
    for mode, (fn, names, _) in MODES.items():
        seen = set()
        for name in names:
            c = count_file(os.path.join(outdir, name), marks)
            for other in c.pop("_script_names"):
                problems.append(f"{name}: frames name the script {other!r}, not {REL!r}")
            for p in c.pop("_machine_paths"):
                print(f"warning: {name}: a frame names the machine path {p!r}", file=sys.stderr)
            seen.update(c["anchors"])
            files[name] = c
        for a in by_func.get(fn.__name__, []):
            if a not in seen:
                problems.append(f"{mode}: no frame at the anchor {a!r} ({REL}:{marks[a][0]})")
    if problems:
        msg = "make_fixtures: the fixtures are not what the tests expect:\n  " + "\n  ".join(problems)
        if strict:
            sys.exit(msg)
        print(msg.replace("make_fixtures:", "warning:"), file=sys.stderr)
    doc = {
        "about": f"Written by {REL}: what Python's pickle.load finds in each fixture. "
                 "The tests read their expected counts from here.",
        "made_with": made_with,
        "files": files,
    }
    with open(os.path.join(outdir, "fixtures.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return table(files, marks)


def main():
    check_invocation()
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "--manifest":
        outdir = args[1]
        old = os.path.join(outdir, "fixtures.json")
        made_with = {}
        if os.path.isfile(old):
            with open(old) as f:
                made_with = json.load(f).get("made_with", {})
        print(manifest(outdir, made_with, strict=False), end="")
        return
    if len(args) != 1 or args[0].startswith("-"):
        sys.exit(__doc__)
    outdir = args[0]
    os.makedirs(outdir, exist_ok=True)
    made_with = torch_environment()
    made_with["script"] = REL
    print(f"making the fixtures with {made_with}", flush=True)
    run_workloads(outdir, list(MODES))
    text = manifest(outdir, made_with, strict=True)
    with open(os.path.join(outdir, "table.md"), "w") as f:
        f.write(text)
    print(f"\nwrote {len(FILES)} fixtures, fixtures.json and table.md to {outdir}; "
          f"the table for tests/fixtures/torch/README.md:\n")
    print(text, end="")


if __name__ == "__main__":
    main()
