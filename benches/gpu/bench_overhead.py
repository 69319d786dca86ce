"""Overhead of memsnap against no recording and PyTorch's own recorder, plus dump time and size.

    python3 bench_overhead.py driver --lib LIB --work DIR --result FILE [--budget S]
    python3 bench_overhead.py worker --result FILE [--recorder none|torch_python|torch_all]
                                     [--dump none|memsnap|torch] [--steps N] [--warmup N]

The driver starts one worker process per row (no preload; memsnap stacks none/python/all in the
default allocator and in backend:cudaMallocAsync; PyTorch's recorder with stacks python/all), then
the dump rows, and writes FILE with every figure. Workload: 6-layer TransformerEncoder (d_model 512,
8 heads, FF 2048, batch 32, sequence 256), Adam; the step time is the median over the timed steps,
with torch.cuda.synchronize() around each step.
"""
import argparse
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
import snaputil as su  # noqa: E402
from snaputil import log  # noqa: E402

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "PYTHONUNBUFFERED": "1"}
ASYNC = "backend:cudaMallocAsync"


# ----------------------------------------------------------------------------------------------
# Worker (one configuration, one process)


BATCH = int(os.environ.get("BENCH_BATCH", 32))
SEQ = int(os.environ.get("BENCH_SEQ", 256))


def build(torch):
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=6).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    # BENCH_BATCH/BENCH_SEQ shrink the step until the CPU (kernel launches, allocator, any
    # recorder) is the bottleneck, so per-event costs show in the step time.
    batch = torch.randn(BATCH, SEQ, 512, device="cuda")
    return model, opt, batch


def step(model, opt, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(a):
    import torch

    res = {"pid": os.getpid(), "recorder": a.recorder, "dump": a.dump,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "memsnap_stacks": os.environ.get("MEMSNAP_STACKS") if os.environ.get("LD_PRELOAD") else None,
           "preload": bool(os.environ.get("LD_PRELOAD"))}
    torch.manual_seed(0)
    stacks = {"torch_python": "python", "torch_all": "all"}.get(a.recorder)
    if stacks:
        torch.cuda.memory._record_memory_history(max_entries=a.max_entries, stacks=stacks)
        res["torch_stacks"] = stacks
    model, opt, batch = build(torch)
    times = []
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, opt, batch)
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    res.update({
        "steps": len(times), "median_ms": statistics.median(times), "mean_ms": statistics.fmean(times),
        "p10_ms": times[len(times) // 10], "p90_ms": times[(len(times) * 9) // 10],
        "min_ms": times[0], "max_ms": times[-1],
        "memory_allocated": torch.cuda.memory_allocated(), "memory_reserved": torch.cuda.memory_reserved(),
    })
    if a.dump == "memsnap":
        folder = os.environ.get("MEMSNAP_FOLDER", ".")
        d = su.request_dump(folder, timeout=120)
        res["dump_s"] = d["wait_s"]
        res["dump_error"] = d["error"]
        if d["file"]:
            res["dump_bytes"] = os.path.getsize(d["file"])
            res["dump_file"] = d["file"]
            t0 = time.perf_counter()
            snap = su.load_snapshot(d["file"])
            res["load_s"] = time.perf_counter() - t0
            res["entries"] = sum(len(x) for x in snap.get("device_traces", []))
            res["events_with_frames"] = su.frames_present(snap)
            res["memsnap_meta"] = {k: v for k, v in su.memsnap_meta(snap).items()
                                   if len(json.dumps(v, default=str)) < 2000}
    elif a.dump == "torch":
        path = os.path.join(a.dump_dir or ".", f"torch-{stacks}.pickle")
        t0 = time.perf_counter()
        torch.cuda.memory._dump_snapshot(path)
        res["dump_s"] = time.perf_counter() - t0
        res["dump_bytes"] = os.path.getsize(path)
        snap = su.load_snapshot(path)
        res["entries"] = sum(len(x) for x in snap.get("device_traces", []))
        os.unlink(path)  # large; not kept
    with open(a.result, "w") as f:
        json.dump(res, f, indent=1, default=str)


# ----------------------------------------------------------------------------------------------
# Driver


def rows(steps, warmup, dump_steps):
    t = {"steps": steps, "warmup": warmup}
    out = [
        {"name": "no_preload/default", "preload": False, "alloc": "", "recorder": "none", **t},
        {"name": "no_preload/cudaMallocAsync", "preload": False, "alloc": ASYNC, "recorder": "none", **t},
    ]
    for alloc, tag in (("", "default"), (ASYNC, "cudaMallocAsync")):
        for st in ("none", "python", "all"):
            out.append({"name": f"memsnap_{st}/{tag}", "preload": True, "stacks": st, "alloc": alloc,
                        "recorder": "none", **t})
    for st in ("python", "all"):
        out.append({"name": f"torch_recorder_{st}/default", "preload": False, "alloc": "",
                    "recorder": f"torch_{st}", **t})
    dump = {"steps": dump_steps, "warmup": 2}
    out += [
        {"name": "dump/memsnap_all/cudaMallocAsync", "preload": True, "stacks": "all", "alloc": ASYNC,
         "recorder": "none", "dump": "memsnap", **dump},
        {"name": "dump/memsnap_python/cudaMallocAsync", "preload": True, "stacks": "python", "alloc": ASYNC,
         "recorder": "none", "dump": "memsnap", **dump},
        {"name": "dump/torch_all/default", "preload": False, "alloc": "", "recorder": "torch_all",
         "dump": "torch", **dump},
        {"name": "dump/torch_python/default", "preload": False, "alloc": "", "recorder": "torch_python",
         "dump": "torch", **dump},
    ]
    return out


def driver(a):
    os.makedirs(a.work, exist_ok=True)
    t_start = time.time()
    lib_ok = os.path.exists(a.lib)
    results = []
    # BENCH_REPEATS > 1 runs the timing rows that many times, interleaved (every other pass in
    # reverse order) so drift and bursts of load hit all rows alike; each row then reports
    # the median of its runs' medians. Dump rows run once.
    all_rows = rows(a.steps, a.warmup, a.dump_steps)
    timing_rows = [r for r in all_rows if not r["name"].startswith("dump/")]
    schedule = []
    for rep in range(max(1, a.repeats)):
        schedule += timing_rows if rep % 2 == 0 else list(reversed(timing_rows))
    schedule += [r for r in all_rows if r["name"].startswith("dump/")]
    for i, row in enumerate(schedule):
        left = a.budget - (time.time() - t_start)
        if row.get("preload") and not lib_ok:
            results.append({**row, "ok": False, "error": f"{a.lib} missing"})
            continue
        if left < 20:
            results.append({**row, "ok": False, "error": "not run: bench time budget used up"})
            log(f"  bench: skipping {row['name']} (budget)")
            continue
        d = os.path.join(a.work, f"row{i:02d}")
        os.makedirs(os.path.join(d, "snaps"), exist_ok=True)
        env = dict(os.environ)
        env.update(SAFE_ENV)
        for k in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING"):
            env.pop(k, None)
        if row["alloc"]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = row["alloc"]
        if row.get("preload"):
            env["LD_PRELOAD"] = a.lib
            env["MEMSNAP_STACKS"] = row["stacks"]
            env["MEMSNAP_FOLDER"] = os.path.join(d, "snaps")
            env["MEMSNAP_MAX_ENTRIES"] = "100000"
            env["MEMSNAP_QUIET"] = "1"
            env["MEMSNAP_AT_EXIT"] = "0"  # no row needs the exit dump; it only costs time
        res_path = os.path.join(d, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "worker", "--result", res_path,
               "--recorder", row["recorder"], "--dump", row.get("dump", "none"),
               "--steps", str(row["steps"]), "--warmup", str(row["warmup"]), "--dump-dir", d]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, timeout=min(a.row_timeout, left - 5))
            rc, err = p.returncode, p.stderr.decode("utf-8", "replace")[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, err = "timeout", ((e.stderr or b"").decode("utf-8", "replace"))[-3000:]
        rec = {**row, "rc": rc, "seconds": round(time.time() - t0, 1)}
        try:
            with open(res_path) as f:
                rec.update(json.load(f))
            rec["ok"] = rc == 0
        except Exception as e:  # noqa: BLE001
            rec["ok"] = False
            rec["error"] = f"no result ({e!r})"
        if not rec["ok"]:
            rec["stderr_tail"] = err
        results.append(rec)
        log(f"  bench {row['name']}: rc={rc} median={rec.get('median_ms')} ms"
            + (f" dump={rec.get('dump_s')} s bytes={rec.get('dump_bytes')} entries={rec.get('entries')}"
               if row.get("dump") else "")
            + ("" if rec["ok"] else f"\n{err}"))
    out = summarize(merge_repeats(results))
    out["seconds"] = round(time.time() - t_start, 1)
    out["repeats"] = max(1, a.repeats)
    with open(a.result, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0 if out["ok"] else 1


def merge_repeats(results):
    """One record per row name: the median of the runs' medians, with every run's median kept."""
    merged, order = {}, []
    for r in results:
        name = r["name"]
        if name not in merged:
            merged[name] = {**r, "run_medians_ms": []}
            order.append(name)
        m = merged[name]
        if r.get("ok") and r.get("median_ms"):
            m["run_medians_ms"].append(r["median_ms"])
            m["ok"] = m.get("ok", True) and True
        elif not r.get("ok"):
            m["ok"] = False
            m["error"] = r.get("error") or m.get("error")
            m["stderr_tail"] = r.get("stderr_tail") or m.get("stderr_tail")
    for name in order:
        m = merged[name]
        runs = m["run_medians_ms"]
        if len(runs) > 1:
            m["median_ms"] = statistics.median(runs)
            m["p10_ms"] = min(runs)
            m["p90_ms"] = max(runs)
    return [merged[n] for n in order]


def summarize(results):
    base = {r["alloc"]: r.get("median_ms") for r in results
            if r["name"].startswith("no_preload") and r.get("ok")}
    timing, dumps = [], []
    for r in results:
        if r["name"].startswith("dump/"):
            dumps.append({k: r.get(k) for k in ("name", "ok", "dump_s", "dump_bytes", "entries", "load_s",
                                                   "events_with_frames", "median_ms", "dump_error",
                                                   "error", "stderr_tail", "memsnap_meta", "rc")})
            continue
        b = base.get(r["alloc"])
        m = r.get("median_ms")
        timing.append({
            "name": r["name"], "ok": r.get("ok"), "median_ms": m, "p10_ms": r.get("p10_ms"),
            "p90_ms": r.get("p90_ms"), "mean_ms": r.get("mean_ms"), "steps": r.get("steps"),
            "overhead_pct": round((m / b - 1) * 100, 2) if (m and b) else None,
            "memory_reserved": r.get("memory_reserved"), "rc": r.get("rc"),
            "run_medians_ms": r.get("run_medians_ms"),
            "error": r.get("error"), "stderr_tail": r.get("stderr_tail"),
        })
    by = {t["name"]: t for t in timing}

    def med(n):
        return (by.get(n) or {}).get("median_ms")

    targets = {}
    ma, base_async = med("memsnap_all/cudaMallocAsync"), med("no_preload/cudaMallocAsync")
    if ma and base_async:
        targets["memsnap_all_tensor_mode_within_5pct"] = ma <= base_async * 1.05
    for st in ("python", "all"):
        m, t = med(f"memsnap_{st}/default"), med(f"torch_recorder_{st}/default")
        if m and t:
            targets[f"memsnap_{st}_below_torch_{st}_default_alloc"] = m < t
        m2 = med(f"memsnap_{st}/cudaMallocAsync")
        if m2 and t:
            targets[f"memsnap_{st}_tensor_mode_below_torch_{st}"] = m2 < t
    dd = {d["name"]: d for d in dumps}
    for st in ("python", "all"):
        m, t = dd.get(f"dump/memsnap_{st}/cudaMallocAsync"), dd.get(f"dump/torch_{st}/default")
        if m and t and m.get("dump_s") and t.get("dump_s"):
            targets[f"dump_{st}_faster_than_torch"] = m["dump_s"] < t["dump_s"]
    return {"ok": all(r.get("ok") for r in results), "timing": timing, "dump": dumps, "targets": targets,
            "workload": f"TransformerEncoder 6x(d512, 8 heads, FF 2048), batch {BATCH}, seq {SEQ}, Adam, fp32"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["driver", "worker"])
    ap.add_argument("--lib", default="target/release/libmemsnap.so")
    ap.add_argument("--work", default="/tmp/memsnap-bench")
    ap.add_argument("--result", required=True)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", 240)))
    ap.add_argument("--row-timeout", type=float, default=90)
    ap.add_argument("--steps", type=int, default=int(os.environ.get("BENCH_STEPS", 50)))
    ap.add_argument("--warmup", type=int, default=int(os.environ.get("BENCH_WARMUP", 10)))
    ap.add_argument("--dump-steps", type=int, default=int(os.environ.get("BENCH_DUMP_STEPS", 80)))
    ap.add_argument("--recorder", default="none")
    ap.add_argument("--dump", default="none")
    ap.add_argument("--dump-dir", default="")
    ap.add_argument("--max-entries", type=int, default=100000)
    ap.add_argument("--repeats", type=int, default=int(os.environ.get("BENCH_REPEATS", 1)))
    a = ap.parse_args()
    a.lib = os.path.abspath(a.lib)
    if a.role == "worker":
        worker(a)
        return 0
    return driver(a)


if __name__ == "__main__":
    sys.exit(main())
