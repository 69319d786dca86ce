"""`memsnap whatif` against the real caching allocator: each workload runs under memsnap with
one setting, `whatif --json` replays its file under the others, then the workload runs again
under each of them and PyTorch's own peak (`torch.cuda.max_memory_reserved()`) is set
against the prediction. On a GPU or on the simulated driver (tests/real_torch.rs):

    python3 scripts/gpu/whatif_check.py --lib LIBMEMSNAP --cli MEMSNAP --out DIR [--cases replay,oom,scale]

- replay: workloads whose requests do not depend on the allocator's settings (random sizes
  and lifetimes; two streams with record_stream; large tensors of drifting sizes; an MLP's
  training steps), each recorded under every setting of SETTINGS. For every recording: the
  replay as recorded must give back its segments and PyTorch's peak, to the byte (memsnap's
  file, and PyTorch's own snapshot of the same run); for every other setting, the prediction
  must equal that setting's own run, to the byte.
- oom: a workload that runs out of memory with the default settings through fragmentation
  (on a device of --capacity bytes: on the simulated driver, FAKE_CUDA_CAPACITY; on a GPU,
  with --fraction, a memory fraction of that many bytes); `whatif` must say expandable_segments:True avoids
  it, and the run with that setting must fit, at the predicted peak.
- scale: a transformer's training steps at batch --batch, recorded; `whatif --scale` of the
  roles that grow with the batch against the same steps run at twice the batch (PyTorch's
  peak reserved; the issue's bound is 10 %).
Writes whatif_check.json into --out and prints one line per case.
"""
import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
MIB = 1 << 20

# The settings every workload is recorded under ("" is PyTorch's defaults).
SETTINGS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:40",
    "roundup_power2_divisions:4",
    "expandable_segments:True,max_split_size_mb:40",
    # Garbage collection acts only under a memory fraction: 5% of the simulated 80 GiB.
    "garbage_collection_threshold:0.3,per_process_memory_fraction:0.05",
]


def child(pattern, own_snapshot):
    """One workload; prints its RESULT (PyTorch's own figures, the files written)."""
    import ctypes
    import torch
    torch.cuda.init()
    if own_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    rng = random.Random(7)
    dev = torch.device("cuda")
    if pattern == "random":
        live = []
        for _ in range(1000):
            if live and rng.random() < 0.45:
                live.pop(rng.randrange(len(live)))
                continue
            kind = rng.random()
            if kind < 0.5:
                size = rng.randrange(1, 1 << 20)  # small pool
            elif kind < 0.85:
                size = rng.randrange(1 << 20, 10 << 20)  # 20 MiB segments
            else:
                size = rng.randrange(10 << 20, 120 << 20)  # their own segments
            live.append(torch.empty(size, dtype=torch.uint8, device=dev))
            if len(live) > 60:
                live.pop(rng.randrange(len(live)))
        torch.cuda.empty_cache()  # in the middle of the run: the replays do the same there
        for _ in range(200):
            live.append(torch.empty(rng.randrange(1, 8 << 20), dtype=torch.uint8, device=dev))
            if len(live) > 40:
                live.pop(0)
    elif pattern == "streams":
        side = torch.cuda.Stream()
        live = []
        for i in range(500):
            size = rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 30 << 20)])
            if i % 3 == 0:
                with torch.cuda.stream(side):
                    t = torch.empty(size, dtype=torch.uint8, device=dev)
            else:
                t = torch.empty(size, dtype=torch.uint8, device=dev)
                if rng.random() < 0.5:
                    t.record_stream(side)  # used on the side stream: its free waits
            live.append(t)
            if len(live) > 30:
                live.pop(rng.randrange(len(live)))
    elif pattern == "oversize":
        live = []
        for i in range(400):
            size = (20 << 20) + rng.randrange(0, 100 << 20) + (i % 7) * 4096
            live.append(torch.empty(size, dtype=torch.uint8, device=dev))
            if len(live) > 8:
                live.pop(rng.randrange(len(live)))
            if i % 50 == 49:
                live.append(torch.empty(rng.randrange(1 << 20, 4 << 20), dtype=torch.uint8, device=dev))
    elif pattern == "training":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(4):
            x = torch.randn(256 + 32 * step, 1024, device=dev)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif pattern == "transformer":
        torch.manual_seed(0)
        batch = int(os.environ.get("WHATIF_BATCH", "16"))
        layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 4).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(4):
            x = torch.randn(batch, 256, 512, device=dev)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif pattern == "fragment":
        # Tensors of 6 MiB share 20 MiB segments; one of each three stays, pinning every
        # segment; then a 24 MiB request finds no free block and no segment to give back.
        acts = [torch.empty(6 << 20, dtype=torch.uint8, device=dev) for _ in range(30)]
        kept = [t for i, t in enumerate(acts) if i % 3 == 1]
        del acts
        big = torch.empty(24 << 20, dtype=torch.uint8, device=dev)  # FRAGMENT
        del big, kept
    result = {
        "max_reserved": torch.cuda.max_memory_reserved(),
        "reserved": torch.cuda.memory_reserved(),
        "allocated": torch.cuda.memory_allocated(),
    }
    if own_snapshot:
        path = os.path.join(os.environ["MEMSNAP_FOLDER"], "pytorch-own.pickle")
        torch.cuda.memory._dump_snapshot(path)
        result["own"] = path
    dump = ctypes.CDLL(None).memsnap_dump_path
    dump.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(4096)
    n = dump(b"whatif", buf, 4096)
    result["memsnap"] = buf.raw[:n].decode()
    print("RESULT", json.dumps(result), flush=True)


def run_child(args, pattern, conf, own=False, env_extra=None):
    folder = tempfile.mkdtemp(prefix="whatif-")
    env = dict(os.environ, MEMSNAP_FOLDER=folder, LD_PRELOAD=os.path.abspath(args.lib), PYTHONUNBUFFERED="1")
    env.pop("PYTORCH_ALLOC_CONF", None)
    env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    env.update(env_extra or {})
    cmd = [sys.executable, HERE, "--child", pattern] + (["--own"] if own else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"error": f"rc {p.returncode}", "stderr": p.stderr[-2000:], "folder": folder}
    return dict(json.loads(lines[-1][len("RESULT "):]), folder=folder)


def whatif(cli, path, sets, extra=()):
    cmd = [cli, "whatif", "--json", *extra, path]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"whatif failed ({p.returncode}): {p.stderr[-800:]}")
    return json.loads(p.stdout)


def label(conf):
    return conf or "defaults"


def case_replay(args):
    patterns = args.patterns.split(",")
    out = {"runs": [], "predictions": [], "own": []}
    for pattern in patterns:
        runs = {conf: run_child(args, pattern, conf, own=(conf == "")) for conf in SETTINGS}
        for conf, r in runs.items():
            if "error" in r:
                out["runs"].append({"pattern": pattern, "setting": label(conf), "error": r})
                continue
            others = [c for c in SETTINGS if c != conf]
            w = whatif(args.cli, r["memsnap"], others)
            first = w["scenarios"][0]
            check = w["checks"][0]
            out["runs"].append({
                "pattern": pattern, "setting": label(conf), "reproduced": check["reproduced"],
                "divergence": check["divergence"], "segment_operations": check["segment_operations"],
                "model_peak": first["peak_reserved_bytes"], "pytorch_peak": r["max_reserved"]})
            for c, row in zip(others, w["scenarios"][1:]):
                actual = runs[c].get("max_reserved")
                out["predictions"].append({
                    "pattern": pattern, "recorded": label(conf), "predicted_for": label(c),
                    "predicted": row["peak_reserved_bytes"], "actual": actual, "refused": row["refused"]})
            if r.get("own"):
                wo = whatif(args.cli, r["own"], [])
                co = wo["checks"][0]
                out["own"].append({
                    "pattern": pattern, "reproduced": co["reproduced"], "divergence": co["divergence"],
                    "model_peak": wo["scenarios"][0]["peak_reserved_bytes"], "pytorch_peak": r["max_reserved"]})
    runs_ok = all(r.get("reproduced") and r["model_peak"] == r["pytorch_peak"] for r in out["runs"])
    pred_ok = all(p["predicted"] == p["actual"] for p in out["predictions"])
    own_ok = all(o["reproduced"] and o["model_peak"] == o["pytorch_peak"] for o in out["own"])
    out["ok"] = runs_ok and pred_ok and own_ok and bool(out["predictions"])
    return out


def case_oom(args):
    env, conf = {}, ""
    if args.capacity and not args.fraction:
        env = {"FAKE_CUDA_CAPACITY": str(args.capacity)}
    elif args.capacity:
        import torch
        total = torch.cuda.get_device_properties(0).total_memory
        conf = f"per_process_memory_fraction:{args.capacity / total:.8f}"
    with_conf = lambda c: ",".join(x for x in (c, conf) if x)
    base = run_child(args, "fragment", conf, env_extra=env)
    files = sorted(glob.glob(os.path.join(base["folder"], "*oom*.pickle")))
    out = {"default": {k: v for k, v in base.items() if k != "stderr"}}
    if not files:
        out["ok"] = False
        out["error"] = "no out-of-memory file"
        out["stderr"] = base.get("stderr", "")
        return out
    w = whatif(args.cli, files[0], [with_conf("expandable_segments:True")])
    out["file"] = files[0]
    out["recorded_oom"] = w["recorded_oom"]
    out["check"] = w["checks"][0]
    out["scenarios"] = w["scenarios"]
    fixed = run_child(args, "fragment", with_conf("expandable_segments:True"), env_extra=env)
    out["expandable_run"] = {k: v for k, v in fixed.items() if k != "stderr"}
    out["ok"] = (bool(w["recorded_oom"]) and with_conf("expandable_segments:True") in w["recorded_oom"]["avoided_by"]
                 and w["scenarios"][1]["fits"] is True and "error" not in fixed
                 and w["scenarios"][1]["peak_reserved_bytes"] == fixed.get("max_reserved"))
    return out


SCALES = ["activations=2,temporaries=2", "activations=2,temporaries=2,other=2"]


def case_scale(args):
    base = run_child(args, "transformer", "", env_extra={"WHATIF_BATCH": str(args.batch)})
    double = run_child(args, "transformer", "", env_extra={"WHATIF_BATCH": str(2 * args.batch)})
    out = {"batch": args.batch, "recorded_peak": base.get("max_reserved"), "double_batch_peak": double.get("max_reserved")}
    if "error" in base or "error" in double:
        out.update(ok=False, error=[base.get("error"), double.get("error")], stderr=base.get("stderr", "") + double.get("stderr", ""))
        return out
    w = subprocess.run([args.cli, "whatif", "--json", base["memsnap"]] + [a for sc in SCALES for a in ("--scale", sc)],
                       capture_output=True, text=True, timeout=600)
    if w.returncode != 0:
        out.update(ok=False, error=w.stderr[-800:])
        return out
    rows = json.loads(w.stdout)["scenarios"]
    out["predictions"] = [{"setting": r["setting"], "predicted": r["peak_reserved_bytes"],
                           "off_by": round(r["peak_reserved_bytes"] / double["max_reserved"] - 1, 4)} for r in rows[1:]]
    out["ok"] = any(abs(p["off_by"]) <= 0.10 for p in out["predictions"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--own", action="store_true")
    ap.add_argument("--lib")
    ap.add_argument("--cli", default="memsnap")
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default="replay,oom")
    ap.add_argument("--patterns", default="random,streams,oversize,training")
    ap.add_argument("--capacity", type=int, default=0, help="the device's bytes for the oom case (the simulated driver's FAKE_CUDA_CAPACITY, or with --fraction a memory fraction)")
    ap.add_argument("--fraction", action="store_true", help="--capacity as a memory fraction (a GPU) rather than the simulated driver's size")
    ap.add_argument("--batch", type=int, default=16, help="the scale case's recorded batch")
    args = ap.parse_args()
    if args.child:
        try:
            child(args.child, args.own)
        except Exception as e:  # the out-of-memory error ends the workload; memsnap wrote its file
            print("RESULT", json.dumps({"error": type(e).__name__, "message": str(e)[:300]}), flush=True)
        return
    results = {}
    for case in args.cases.split(","):
        t0 = time.time()
        try:
            results[case] = {"replay": case_replay, "oom": case_oom, "scale": case_scale}[case](args)
        except Exception as e:  # the record says what broke
            results[case] = {"ok": False, "error": repr(e)}
        results[case]["seconds"] = round(time.time() - t0, 1)
        print(case, json.dumps(results[case])[:3000], flush=True)
    with open(os.path.join(args.out, "whatif_check.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
