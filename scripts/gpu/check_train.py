#!/usr/bin/env python3
"""Checks one training run of scripts/gpu/wheel_train.sh (standard library only).

    check_train.py --name NAME --folder SNAPS --script TRAIN.py --stdout RUN.out \
        --skip 2 --interval 2 --batches 6 --cli MEMSNAP --json RESULTS.json

The run was `memsnap run --skip S --interval I -- python TRAIN.py`, and TRAIN.py trained
BATCHES batches with memsnap's callback. Checks, each printed as PASS/FAIL with its detail:

- `script`: the script printed `result loaded=True` and `result global_step=BATCHES`;
- `window_snapshot`: exactly one `step` snapshot, written at step S+I (the window's end);
- `window_events`: its history holds allocations (the window's own events);
- `script_lines`: the stacks of those events name the lines of TRAIN.py marked
  `# memsnap-check` (the forward and the loss, inside the training step);
- `one_step_per_batch`: the exit snapshot says BATCHES steps were counted;
- `memsnap_check`: the installed `memsnap check` accepts every file.

Appends one record {name, ok, checks: [{name, ok, detail}], files} to RESULTS.json (a JSON
list; created when missing). Exit status 0 when every check passed.
"""

import argparse
import json
import os
import pickle
import subprocess
import sys


def results(path):
    out = {}
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("result ") and "=" in line:
                    key, value = line[len("result "):].rstrip("\n").split("=", 1)
                    out[key] = value
    except OSError:
        pass
    return out


def marked_lines(script):
    with open(script) as f:
        return {n for n, line in enumerate(f, 1) if line.rstrip().endswith("# memsnap-check")}


def load(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def main():
    ap = argparse.ArgumentParser()
    for flag in ("--name", "--folder", "--script", "--stdout", "--cli", "--json"):
        ap.add_argument(flag, required=True)
    for flag in ("--skip", "--interval", "--batches"):
        ap.add_argument(flag, type=int, required=True)
    a = ap.parse_args()

    checks = []

    def check(name, ok, detail):
        checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print("%s %s: %s: %s" % ("PASS" if ok else "FAIL", a.name, name, detail), flush=True)

    printed = results(a.stdout)
    check(
        "script",
        printed.get("loaded") == "True" and printed.get("global_step") == str(a.batches),
        "loaded=%s global_step=%s (expected True, %d); %s"
        % (printed.get("loaded"), printed.get("global_step"), a.batches, printed.get("framework")),
    )

    files = sorted(
        os.path.join(a.folder, n) for n in os.listdir(a.folder) if n.endswith(".pickle")
    ) if os.path.isdir(a.folder) else []
    snaps = {}
    for path in files:
        try:
            snaps[path] = load(path)
        except Exception as e:  # a file the check below reports as unreadable
            snaps[path] = {"error": repr(e)}
    meta = {p: s.get("memsnap", {}) for p, s in snaps.items()}
    windows = [p for p in files if meta[p].get("reason") == "step"]
    exits = [p for p in files if meta[p].get("reason") == "exit"]
    window_step = a.skip + a.interval
    check(
        "window_snapshot",
        len(windows) == 1 and meta[windows[0]].get("step") == window_step,
        "step snapshots: %s (expected one, at step %d)"
        % ([(os.path.basename(p), meta[p].get("step")) for p in windows], window_step),
    )

    events = []
    if windows:
        for trace in snaps[windows[0]].get("device_traces", []):
            events.extend(e for e in trace if e.get("action") in ("alloc", "segment_alloc"))
    check("window_events", events, "%d allocation events in the window's history" % len(events))

    wanted = marked_lines(a.script)
    script_name = os.path.basename(a.script)
    seen = {}
    for e in events:
        for frame in e.get("frames", []):
            if os.path.basename(str(frame.get("filename", ""))) == script_name:
                line = frame.get("line")
                seen.setdefault(line, set()).add(frame.get("name"))
    named = sorted(set(seen) & wanted)
    check(
        "script_lines",
        named,
        "%s lines in the window's stacks: %s; marked lines %s found: %s"
        % (
            script_name,
            ", ".join("%s (%s)" % (n, "/".join(sorted(map(str, seen[n])))) for n in sorted(seen))
            or "none",
            sorted(wanted),
            named,
        ),
    )

    check(
        "one_step_per_batch",
        len(exits) == 1 and meta[exits[0]].get("step") == a.batches,
        "exit snapshots: %s (expected one, at step %d)"
        % ([(os.path.basename(p), meta[p].get("step")) for p in exits], a.batches),
    )

    if files:
        run = subprocess.run([a.cli, "check"] + files, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, universal_newlines=True)
        check("memsnap_check", run.returncode == 0,
              "%d files, exit %d: %s" % (len(files), run.returncode, run.stdout.strip()[-400:]))
    else:
        check("memsnap_check", False, "no snapshot files in %s" % a.folder)

    record = {
        "name": a.name,
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
        "files": [
            {"file": os.path.basename(p), "bytes": os.path.getsize(p),
             "reason": meta[p].get("reason"), "step": meta[p].get("step")}
            for p in files
        ],
    }
    try:
        with open(a.json) as f:
            everything = json.load(f)
    except (OSError, ValueError):
        everything = []
    everything.append(record)
    with open(a.json, "w") as f:
        json.dump(everything, f, indent=2)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
