"""Which line leaks, from a plain run: `LD_PRELOAD=libmemsnap.so python train.py` and nothing
else (no import of memsnap, no callback, no step call), on a real GPU with PyTorch's default
caching allocator.

    python3 scripts/gpu/plain_leak.py --lib LIBMEMSNAP --cli MEMSNAP --out $OUT

The workload: a 6-layer TransformerEncoder trained for 20 optimizer steps; after each step an
evaluation pass runs without `no_grad` and its output is kept in a list, so each evaluation's
graph (its activations) stays alive: the leak. The child measures
`torch.cuda.memory_allocated()` after every iteration; the leak's bytes per iteration are the
median of its growth over the second half.

- plain: the preload alone. `memsnap explain --json` on the exit file must name the
  evaluation line (`# EVAL`) as a leak, with bytes per iteration within 10% of the measured
  growth.
- torch: the same run recording PyTorch's own history (`_record_memory_history`, then
  `_dump_snapshot`); `explain --json` on PyTorch's file, the same check.
- every: `MEMSNAP_EVERY=5`: the automatic optimizer-step marks write step files at steps 5,
  10, 15 and 20 (four files), each saying its steps came from the optimizer.

Writes plain_leak.json into --out and prints one line per case.
"""
import argparse
import glob
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.abspath(__file__)
ITERATIONS = 20


def child(record_torch_to):
    import torch
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=1024, nhead=16, dim_feedforward=4096, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if record_torch_to:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    kept, allocated = [], []
    for _ in range(ITERATIONS):
        x = torch.randn(16, 256, 1024, device="cuda")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        kept.append(model(torch.randn(16, 256, 1024, device="cuda")).mean())  # EVAL
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    if record_torch_to:
        torch.cuda.memory._dump_snapshot(record_torch_to)
    print("RESULT", json.dumps({"allocated": allocated}))


def line_of(marker):
    with open(HERE) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "line_of" not in line:
                return i
    return None


def run_child(args, folder, env_extra=None, record_torch_to=None):
    env = dict(os.environ, MEMSNAP_FOLDER=folder, LD_PRELOAD=os.path.abspath(args.lib), PYTHONUNBUFFERED="1")
    env.update(env_extra or {})
    cmd = [sys.executable, HERE, "--child"] + ([record_torch_to] if record_torch_to else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    result = next((json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    return p, result


def growth_per_iteration(allocated):
    """The median growth of memory_allocated() over the second half of the iterations."""
    half = allocated[len(allocated) // 2 - 1:]
    return statistics.median(b - a for a, b in zip(half, half[1:]))


def explain(cli, paths):
    p = subprocess.run([cli, "explain", "--json", *paths], capture_output=True, text=True, timeout=600)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"explain failed ({p.returncode}): {p.stderr[-800:]}")
    return json.loads(p.stdout)


def leak_check(e, measured):
    """The leak named at the evaluation line and its bytes per iteration against `measured`."""
    line = line_of("# EVAL")
    leaks = e.get("leaks") or []
    mine = [l for l in leaks if f"plain_leak.py:{line}" in l.get("site", "")]
    out = {"eval_line": line, "measured_bytes_per_iteration": measured,
           "leaks": [{k: l.get(k) for k in ("site", "unit", "bytes_per_step", "bytes_per_iteration",
                                              "first_step", "live_bytes_at_end")} for l in leaks[:4]],
           "iterations": e.get("iterations"), "notes": (e.get("notes") or [])[:4]}
    if not mine:
        return dict(out, ok=False, error="no leak at the evaluation line")
    per = mine[0].get("bytes_per_iteration") or mine[0].get("bytes_per_step")
    out["found_bytes_per_iteration"] = per
    out["ratio"] = per / measured if measured else None
    out["ok"] = bool(measured) and abs(per / measured - 1) <= 0.10
    return out


def case_plain(args):
    folder = tempfile.mkdtemp(prefix="plain-leak-")
    p, result = run_child(args, folder)
    exits = sorted(glob.glob(os.path.join(folder, "*-exit-*.pickle")))
    if not result or not exits:
        return {"ok": False, "error": "no result or no exit file", "rc": p.returncode, "stderr": p.stderr[-1500:]}
    return leak_check(explain(args.cli, exits[-1:]), growth_per_iteration(result["allocated"]))


def case_torch(args):
    folder = tempfile.mkdtemp(prefix="plain-leak-torch-")
    own = os.path.join(folder, "torch-own.pickle")
    p, result = run_child(args, folder, record_torch_to=own)
    if not result or not os.path.exists(own):
        return {"ok": False, "error": "no result or no PyTorch snapshot", "rc": p.returncode,
                "stderr": p.stderr[-1500:]}
    return leak_check(explain(args.cli, [own]), growth_per_iteration(result["allocated"]))


def case_every(args):
    folder = tempfile.mkdtemp(prefix="plain-leak-every-")
    p, result = run_child(args, folder, {"MEMSNAP_EVERY": "5"})
    steps = sorted(glob.glob(os.path.join(folder, "*-step-*.pickle")))
    sources, marks = [], []
    for path in steps:
        with open(path, "rb") as f:
            meta = pickle.load(f).get("memsnap", {})
        sources.append(meta.get("step_source"))
        marks.append(meta.get("step"))
    return {"ok": len(steps) == ITERATIONS // 5, "step_files": [os.path.basename(s) for s in steps],
            "steps": marks, "step_source": sources, "rc": p.returncode,
            "stderr": p.stderr[-800:] if p.returncode else ""}


CASES = {"plain": case_plain, "torch": case_torch, "every": case_every}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2] if len(sys.argv) > 2 else None)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--cli", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    results = {}
    for name in args.cases.split(","):
        try:
            results[name] = CASES[name](args)
        except Exception as exc:  # one case's failure is reported, the others still run
            results[name] = {"ok": False, "error": repr(exc)}
        print(name, "ok" if results[name].get("ok") else "FAILED",
              json.dumps({k: v for k, v in results[name].items() if k not in ("leaks", "notes", "iterations")}))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plain_leak.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
