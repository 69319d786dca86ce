"""`memsnap explain` on real PyTorch jobs (default caching allocator, no code change):

    python3 scripts/gpu/explain_check.py --lib LIBMEMSNAP --cli MEMSNAP --out $OUT [--cases oom,leak,ddp]

- oom: a model run with an ever larger batch until PyTorch raises OutOfMemoryError; `explain
  --json` on the OOM file must give a verdict and put the forward pass's line among the top
  sites (the line is printed by the case).
- leak: a training loop whose evaluation pass runs without no_grad and keeps its outputs, one
  snapshot per step (memsnap.step()); `explain --json` on the folder must report a leak on
  the leaking line, and none on the same loop without the leak.
- ddp: `torchrun --nproc_per_node 2` DDP training (NCCL), a snapshot on each rank at the end
  while everything is live; for each rank `explain --json --at end`: the owners table against
  the device memory in use (capacity − the driver's free bytes): which share memsnap recorded
  by owner, which share is outside what it recorded (contexts, other processes), and the
  share with an unknown owner. Needs 2 GPUs.
Writes explain_check.json into --out and prints one line per case.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
MIB = 1 << 20


def explain(cli, paths, *extra):
    p = subprocess.run([cli, "explain", "--json", *extra, *paths], capture_output=True, text=True, timeout=300)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"explain failed ({p.returncode}): {p.stderr[-500:]}")
    return json.loads(p.stdout)


def child_oom():
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(4096, 16384), torch.nn.GELU(), torch.nn.Linear(16384, 4096)).cuda()
    batch = 1024
    while True:
        x = torch.randn(batch, 4096, device="cuda")
        try:
            y = model(x)  # FORWARD
            y.sum().backward()
        except torch.OutOfMemoryError:
            print("RESULT", json.dumps({"batch": batch}))
            return
        batch *= 2


def child_leak(leak):
    import torch
    import memsnap
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    for _ in range(16):
        x = torch.randn(512, 1024, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out = model(torch.randn(1024, 1024, device="cuda"))  # EVAL
        if leak:
            kept.append(out)
        del out
        memsnap.step()


def child_ddp():
    import torch
    import torch.distributed as dist
    import memsnap
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)  # before init_process_group: no context on another rank's GPU
    dist.init_process_group("nccl")
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 2048)).cuda(),
        device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(6):
        model(torch.randn(256, 2048, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    path = memsnap.dump(f"end{rank}")
    record = {"rank": rank, "free": free, "total": total, "path": path}
    with open(os.path.join(os.environ["MEMSNAP_FOLDER"], f"result-{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def line_of(marker):
    with open(HERE) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "line_of" not in line:
                return i
    return None


def run_child(args, case, folder, env_extra=None, launcher=None):
    env = dict(os.environ, MEMSNAP_FOLDER=folder, LD_PRELOAD=os.path.abspath(args.lib), PYTHONUNBUFFERED="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    env["PYTHONPATH"] = os.path.join(os.path.dirname(HERE), "..", "..", "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    cmd = (launcher or [sys.executable]) + [HERE, "--child", case]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def case_oom(args):
    folder = tempfile.mkdtemp(prefix="explain-oom-")
    p = run_child(args, "oom", folder)
    files = sorted(glob.glob(os.path.join(folder, "*oom*.pickle")))
    if not files:
        return {"ok": False, "error": "no OOM file", "stderr": p.stderr[-1500:]}
    e = explain(args.cli, files[:1])
    oom = e.get("oom") or {}
    line = line_of("# FORWARD")
    sites = [s["site"] for s in oom.get("sites", [])]
    named = any(f"explain_check.py:{line}" in s for s in sites[:3])
    return {"ok": bool(oom) and named, "verdict": oom.get("verdict"), "request_bytes": oom.get("request_bytes"),
            "device_free_bytes": oom.get("device_free_bytes"), "sites": sites[:5], "forward_line": line,
            "owners": oom.get("owners"), "reserved_unallocated_bytes": oom.get("reserved_unallocated_bytes")}


def case_leak(args):
    out = {}
    for leak in (True, False):
        folder = tempfile.mkdtemp(prefix="explain-leak-")
        p = run_child(args, "leak" if leak else "noleak", folder, {"MEMSNAP_EVERY": "1"})
        e = explain(args.cli, [folder])
        out["leak" if leak else "steady"] = {"leaks": e.get("leaks"), "notes": e.get("notes", [])[:4],
                                             "rc": p.returncode, "files": len(os.listdir(folder))}
    line = line_of("# EVAL")
    found = out["leak"]["leaks"] or []
    out["eval_line"] = line
    out["ok"] = (any(f"explain_check.py:{line}" in l["site"] for l in found[:2])
                 and not out["steady"]["leaks"])
    return out


def case_ddp(args):
    folder = tempfile.mkdtemp(prefix="explain-ddp-")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    p = run_child(args, "ddp", folder, launcher=launcher)
    results = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(folder, "result-*.json")))]
    ranks = []
    for r in sorted(results, key=lambda r: r["rank"]):
        e = explain(args.cli, [r["path"]], "--at", "end")
        owners = e.get("owners") or {}
        in_use = r["total"] - r["free"]
        recorded = sum(b for k, b in owners.items() if k != "outside memsnap")
        unknown = owners.get("unknown", 0)
        ranks.append({"rank": r["rank"], "in_use_bytes": in_use, "owners": owners,
                      "owners_share": sum(owners.values()) / in_use if in_use else None,
                      "recorded_share": recorded / in_use if in_use else None,
                      "outside_share": owners.get("outside memsnap", 0) / in_use if in_use else None,
                      "unknown_share": unknown / in_use if in_use else None})
    ok = len(ranks) == 2 and all(r["owners_share"] is not None and r["owners_share"] >= 0.99
                                 and r["unknown_share"] <= 0.01 for r in ranks)
    return {"ok": ok, "ranks": ranks, "rc": p.returncode, "stdout": p.stdout[-800:] if not ok else "",
            "stderr": p.stderr[-1500:] if not ok else ""}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--lib")
    ap.add_argument("--cli", default="memsnap")
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default="oom,leak")
    args = ap.parse_args()
    if args.child:
        {"oom": child_oom, "leak": lambda: child_leak(True), "noleak": lambda: child_leak(False),
         "ddp": child_ddp}[args.child]()
        return
    results = {}
    for case in args.cases.split(","):
        t0 = time.time()
        try:
            results[case] = {"oom": case_oom, "leak": case_leak, "ddp": case_ddp}[case](args)
        except Exception as e:  # the record says what broke
            results[case] = {"ok": False, "error": repr(e)}
        results[case]["seconds"] = round(time.time() - t0, 1)
        print(case, json.dumps(results[case])[:3000], flush=True)
    with open(os.path.join(args.out, "explain_check.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
