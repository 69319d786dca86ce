"""PyTorch's default caching allocator on a real GPU: memsnap's blocks against PyTorch's own.

    python3 scripts/gpu/torch_blocks.py --lib target/gpu/libmemsnap.so --cli target/gpu/memsnap \
        --out $OUT [--cases compare,expandable,graphs,step,leak,oom,cost,cost-async] [--cost-rounds 3] [--blocks 12]
        [--isolate]

Each case runs in its own process with libmemsnap.so preloaded (no allocator switch, no code
change) and writes one JSON record; the driver prints a table and writes results.json:

- compare / expandable: mixed tensor allocations and frees (small and large pools, a free
  held back by record_stream on a side stream), then, with nothing allocated in between,
  PyTorch's own torch.cuda.memory._snapshot() and memsnap's snapshot (memsnap_dump_path).
  Checks: the same segments (address, size) and, in each, the same blocks (address, size,
  state; requested size of live blocks); torch.cuda.memory_allocated() equal to the bytes of
  memsnap's live blocks; the snapshot's memsnap.torch_allocator line starts with "blocks".
  expandable runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
- graphs: CUDA graphs' private pools. Eager tensors, then a model's forward captured by hand
  (torch.cuda.graph: the graph's own pool) and a function compiled with torch.compile's
  mode="reduce-overhead" (its graphs share a pool from torch.cuda.graph_pool_handle()), run a
  few times; then the comparison above, and every segment's segment_pool_id in memsnap's
  snapshot equal to PyTorch's (at least one private pool there); `memsnap summary` of
  memsnap's snapshot prints a `private   pool (a, b): ...` line for each private pool.
- step: the same comparison in a real training step (benches/gpu/step_time.py's transformer): after the
  forward pass of a fourth step, with the activations autograd keeps live, and after its
  optimizer step.
- leak: a training loop whose evaluation pass runs without no_grad and keeps its outputs;
  memsnap snapshots at steps 3 and 11, `memsnap diff` between them must put the growth on the
  leaking line (the line number is printed by the case).
- oom: a cache fragmented by 6 MiB tensors (every other one freed), then a request larger than
  any hole; the OOM snapshot must show the reserved-but-unallocated bytes (inactive blocks) and
  the largest free block, equal to what PyTorch's own snapshot says in the except clause (over
  the segments both have).
- cost: per block event, one process per configuration, recording switched on and off in
  alternating blocks of the same loop inside the process (memsnap_debug_pass_through, in
  builds with the bench-hooks feature), against PyTorch's recorder switched on and off the same
  way in its own process; cached tensors only (no CUDA call). Each recorded block is paired with
  the unrecorded block beside it; per process: median, quartiles and every paired difference,
  and the median on/off ratio; over processes (torch_blocks_cost.json and the printed table):
  the median and IQR of the per-process medians, and PyTorch's recorder over memsnap per round.
  The recorder's rows: python, all, and none (its history of entries without stacks: what
  PyTorch spends building and keeping an entry, the part an attached tracker's entries share,
  which memsnap's own on/off blocks both contain; docs/HOT-PATH.md). Checked: memsnap's snapshot says 0 dropped, 0 without a stack, and its
  memsnap.torch_allocator line starts with "blocks" (the tracker saw the blocks). With
  --isolate each cost process, after its warm-up, pins the loop's thread to one core and
  moves every other thread (memsnap's writer, CUDA's) off that core, as step_time.py
  --isolate does (scripts/gpu/pinning.py); each record says the core and the threads moved.
- cost-async: the same loop and the same paired blocks with
  PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (tensor mode: every tensor one
  cudaMallocAsync and one cudaFreeAsync that memsnap's CUDA hooks record, two events an
  iteration), memsnap only: PyTorch's recorder records only its native allocator, so the
  ratio is taken against the recorder rows of the cost case of the same rounds (run both).
  Checked as above, with "tensors" on the allocator line and PyTorch on its cudaMallocAsync
  backend. This is the paired-block median of tensor mode that
  benches/gpu/hook_cost_torch.py's best-of-five loops give only as a best.
"""
import argparse
import ctypes
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from pinning import pin_main_thread  # noqa: E402
from snaputil import memsnap_dump  # noqa: E402

MIB = 1 << 20


def memsnap_counts(tag):
    """A snapshot dumped now, read back: its losses, its allocator line, its events and how often
    a hook waited for room (the writer behind)."""
    with open(memsnap_dump(tag), "rb") as f:
        meta = pickle.load(f).get("memsnap", {})
    return {"dropped": meta.get("dropped_events"), "without_stack": meta.get("events_without_stack"),
            "torch_allocator": meta.get("torch_allocator"), "events": meta.get("events_recorded"),
            "hook_waits": (meta.get("hook_queue_waits") or 0) + (meta.get("hook_slot_waits") or 0)}


def blocks_of(segments, device=0):
    """{segment address: (total_size, [(address, size, state, requested or None)])}."""
    out = {}
    for seg in segments:
        if seg.get("device", 0) != device:
            continue
        blocks = []
        addr = seg["address"]
        for b in seg["blocks"]:
            active = b["state"] != "inactive"
            blocks.append((addr, b["size"], b["state"], b.get("requested_size") if active else None))
            addr += b["size"]
        out[seg["address"]] = (seg["total_size"], blocks)
    return out


def compare_segments(torch_segs, memsnap_segs):
    """Differences between PyTorch's caching-allocator segments and memsnap's (same addresses
    only: memsnap also has other libraries' allocations, which PyTorch cannot see)."""
    t = blocks_of(torch_segs)
    m = blocks_of(memsnap_segs)
    problems = []
    for addr, (size, blocks) in sorted(t.items()):
        if addr not in m:
            problems.append(f"segment {addr:#x} ({size}) missing in memsnap")
            continue
        msize, mblocks = m[addr]
        if msize != size:
            problems.append(f"segment {addr:#x}: size {msize} in memsnap, {size} in PyTorch")
        if mblocks != blocks:
            problems.append(f"segment {addr:#x}: blocks differ: memsnap {mblocks[:6]} PyTorch {blocks[:6]}")
    extra = sorted(set(m) - set(t))
    return problems, extra


def mixed_workload(torch):
    """Allocations that exercise both pools, splits, merges and unsplit tails."""
    keep = []
    sizes = [4, 512, 1000, 8192, 300_000, MIB, MIB + 1, 3 * MIB, 5 * MIB + 512, 12 * MIB, 19 * MIB,
             26 * MIB + 7, 700, 2 * MIB - 100]
    for round_ in range(6):
        for i, s in enumerate(sizes):
            t = torch.empty(s, dtype=torch.uint8, device="cuda")
            if (i + round_) % 3 != 0:
                keep.append(t)
        del keep[::4]
    side = torch.cuda.Stream()
    held = torch.empty(6 * MIB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy while the snapshots are taken
    held.record_stream(side)
    del held  # pending until the side stream passes this point
    return keep, side


def compared(torch, tag):
    """PyTorch's own snapshot and memsnap's (tagged `tag`), taken now with nothing allocated in
    between, compared segment by segment and block by block, with PyTorch's counters. Returns
    (the figures, memsnap's snapshot)."""
    allocated = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    tsnap = torch.cuda.memory._snapshot()
    with open(memsnap_dump(tag), "rb") as f:
        msnap = pickle.load(f)
    problems, extra = compare_segments(tsnap["segments"], msnap["segments"])
    meta = msnap.get("memsnap", {})
    # torch.cuda.memory_allocated(): blocks not freed yet (a pending free is no longer allocated).
    live_block_bytes = sum(b["size"] for s in msnap["segments"] if s["address"] in blocks_of(tsnap["segments"])
                           for b in s["blocks"] if b["state"] == "active_allocated")
    dev0 = next((d for d in meta.get("devices", []) if d.get("device") == 0), {})
    pending = sum(1 for s in tsnap["segments"] for b in s["blocks"] if b["state"] == "active_pending_free")
    frames_on_blocks = sum(1 for s in msnap["segments"] for b in s["blocks"]
                           if b["state"] != "inactive" and b.get("frames"))
    live_blocks = sum(1 for s in msnap["segments"] for b in s["blocks"] if b["state"] != "inactive")
    figures = {
        "torch_allocator": meta.get("torch_allocator"),
        "segments_torch": len(tsnap["segments"]),
        "expandable_segments_torch": sum(1 for s in tsnap["segments"] if s.get("is_expandable")),
        "segments_memsnap": len(msnap["segments"]),
        "memsnap_only_segments": len(extra),
        "blocks_torch": sum(len(s["blocks"]) for s in tsnap["segments"]),
        "pending_free_blocks_torch": pending,
        "problems": problems[:20],
        "problem_count": len(problems),
        "memory_allocated": allocated,
        "memory_reserved": reserved,
        "memsnap_live_block_bytes": live_block_bytes,
        "memsnap_cache_allocated_bytes": dev0.get("cache_allocated_bytes"),
        "memsnap_cache_reserved_bytes": dev0.get("cache_reserved_bytes"),
        "live_blocks_with_frames": frames_on_blocks,
        "live_blocks": live_blocks,
        "dropped": meta.get("dropped_events"),
        "without_stack": meta.get("events_without_stack"),
        "cache_mismatches": meta.get("cache_mismatches"),
    }
    figures["ok"] = (not problems and str(meta.get("torch_allocator", "")).startswith("blocks")
                     and allocated == live_block_bytes and dev0.get("cache_allocated_bytes") == allocated
                     and dev0.get("cache_reserved_bytes") == reserved and frames_on_blocks == live_blocks)
    return figures, msnap


def case_compare(args):
    import torch
    torch.cuda.init()
    keep, side = mixed_workload(torch)
    figures, msnap = compared(torch, "compare")
    # Every entry's time lies within this process's life: block events carry PyTorch's own
    # time-stamp counter reading (TraceEntry::time_), CUDA calls memsnap's; the writer turns
    # both into the wall clock.
    now_us = int(time.time() * 1e6)
    times = [e["time_us"] for trace in msnap.get("device_traces", []) for e in trace]
    outside = sum(1 for t in times if not PROCESS_START_US <= t <= now_us)
    side.synchronize()
    return {
        "trace_entries": len(times),
        "times_outside_run": outside,
        "block_entry_times": [e["time_us"] for trace in msnap.get("device_traces", []) for e in trace
                              if e.get("action") == "alloc"][:3],
        "run_us": [PROCESS_START_US, now_us],
        **figures,
        "ok": figures["ok"] and bool(times) and outside == 0,
    }


def pool_ids(segments, device=0):
    """{segment address: its segment_pool_id as a tuple} of one device."""
    return {s["address"]: tuple(s.get("segment_pool_id", (0, 0)))
            for s in segments if s.get("device", 0) == device}


def case_graphs(args):
    import torch
    torch.cuda.init()
    eager = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (1000, 300_000, 3 * MIB, 12 * MIB)]
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    static_x = torch.randn(64, 1024, device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    graph.replay()
    compiled = torch.compile(lambda x: torch.relu(x @ x.T) + 1, mode="reduce-overhead")
    z = torch.randn(512, 512, device="cuda")
    outs = [compiled(z).clone() for _ in range(4)]
    torch.cuda.synchronize()
    figures, msnap = compared(torch, "graphs")
    tsnap = torch.cuda.memory._snapshot()  # the same state: nothing allocated since
    want, got = pool_ids(tsnap["segments"]), pool_ids(msnap["segments"])
    differ = {hex(a): [list(p), list(got.get(a, ()))] for a, p in sorted(want.items()) if got.get(a) != p}
    private = sorted({p for p in want.values() if p != (0, 0)})
    path = memsnap_dump("graphs-summary")
    text = subprocess.run([args.cli, "summary", path], capture_output=True, text=True).stdout
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("private ")]
    named = all(any(f"pool ({a}, {b}):" in line for line in lines) for a, b in private)
    del eager, static_y, outs
    return {
        "private_pools_torch": [list(p) for p in private],
        "private_segments_torch": sum(1 for p in want.values() if p != (0, 0)),
        "pool_id_differences": dict(list(differ.items())[:10]),
        "pool_id_difference_count": len(differ),
        "summary_private_lines": lines,
        **figures,
        "ok": figures["ok"] and bool(private) and not differ and named,
    }


def case_step(args):
    """The transformer training step of step_time.py (transformer_step.TorchWorkload: 4 encoder layers, bf16
    autocast, AdamW), three steps, then a fourth: memsnap's blocks against PyTorch's snapshot
    after its forward pass (the activations autograd keeps live) and after the optimizer."""
    from transformer_step import TorchWorkload, add_workload_args
    workload_args = argparse.ArgumentParser()
    add_workload_args(workload_args)
    a = workload_args.parse_args([])
    wl = TorchWorkload(a)
    torch = wl.torch
    for _ in range(3):
        wl.step()
    x, y = wl.batches[0]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=wl.bf16):
        loss = wl.F.cross_entropy(wl.model(x, wl.mask).view(-1, a.vocab), y)
    forward, _ = compared(torch, "forward")
    loss.backward()
    wl.opt.step()
    wl.opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    after, _ = compared(torch, "after")
    return {"forward": forward, "after": after, "ok": forward["ok"] and after["ok"]}


LEAK_LINE = None
PROCESS_START_US = int(time.time() * 1e6)


def case_leak(args):
    import torch
    import inspect
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    paths = {}

    def evaluate(x):
        out = model(x)  # evaluation without no_grad: the graph stays alive with `out`
        kept.append(out)  # LEAK: every step's output (and its graph) is kept

    leak_line = inspect.getsourcelines(evaluate)[1] + 1
    for step in range(1, 15):
        x = torch.randn(512, 1024, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        evaluate(torch.randn(2048, 1024, device="cuda"))
        if step in (3, 11):
            paths[step] = memsnap_dump(f"step{step}")
    counts = memsnap_counts("end")
    diff = subprocess.run([args.cli, "diff", paths[3], paths[11]], capture_output=True, text=True, timeout=120)
    text = diff.stdout
    top = [line for line in text.splitlines() if ".py:" in line][:3]
    named = any(f"torch_blocks.py:{leak_line}" in line for line in top[:1])
    return {
        **counts,
        "leak_line": leak_line,
        "diff_top_lines": top,
        "diff_exit": diff.returncode,
        "leak_named_first": named,
        "ok": named and counts["dropped"] == 0 and counts["without_stack"] == 0,
        "diff_head": text[:1500],
    }


def case_oom(args):
    import torch
    free, total = torch.cuda.mem_get_info()
    chunks = []
    # Fragment the cache: 6 MiB tensors fill 20 MiB segments three at a time; freeing every
    # other one leaves 6-8 MiB holes in segments that stay (each keeps a live tensor).
    try:
        for _ in range(int(free * 0.9 // (6 * MIB))):
            chunks.append(torch.empty(6 * MIB, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        pass
    del chunks[1::2]
    time.sleep(2.5)  # past memsnap's 2 s OOM episode window, so the next OOM writes a file
    folder = os.environ["MEMSNAP_FOLDER"]
    before = set(os.listdir(folder))
    tsnap = None
    try:
        torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        tsnap = torch.cuda.memory._snapshot()
    time.sleep(0.5)
    new = sorted(set(os.listdir(folder)) - before)
    oom_files = [f for f in new if "oom" in f]
    if not oom_files or tsnap is None:
        return {"ok": False, "error": f"no OOM snapshot ({new}) or no OOM", "oom": tsnap is not None}
    with open(os.path.join(folder, oom_files[0]), "rb") as f:
        msnap = pickle.load(f)

    def free_stats(segs):
        inactive = [b["size"] for s in segs for b in s["blocks"] if b["state"] == "inactive"]
        return sum(inactive), max(inactive, default=0)

    t_inactive, t_largest = free_stats(tsnap["segments"])
    m_inactive, m_largest = free_stats([s for s in msnap["segments"]
                                        if s["address"] in {t["address"] for t in tsnap["segments"]}])
    ooms = [e for t in msnap["device_traces"] for e in t if e["action"] == "oom"]
    return {
        "oom_file": oom_files[0],
        "torch_inactive_bytes": t_inactive,
        "torch_largest_free_block": t_largest,
        "memsnap_inactive_bytes": m_inactive,
        "memsnap_largest_free_block": m_largest,
        "oom_events": len(ooms),
        "oom_device_free": [e.get("device_free") for e in ooms],
        "ok": m_inactive > 0 and m_inactive == t_inactive and m_largest == t_largest and bool(ooms),
    }


def cost_loop(torch, n, sizes):
    """n allocations and frees of cached tensors, 12 Python frames deep."""
    def deep(k, s):
        if k:
            return deep(k - 1, s)
        return torch.empty(s, dtype=torch.uint8, device="cuda")
    live = [None] * 16
    for i in range(n):
        live[i % 16] = deep(10, sizes[i % len(sizes)])


def recorder_on(torch, stacks):
    """PyTorch's recorder switched on with `stacks` ("python" or "all"); "none": its history of
    entries without any stack (context=None): what PyTorch spends building and keeping the
    entries alone, the part a tracker's entries share."""
    if stacks == "none":
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks=stacks)


def quartiles(values):
    """(first quartile, third quartile) of values (the median of each half)."""
    v = sorted(values)
    half = len(v) // 2
    lo, hi = v[:half] or v, v[len(v) - half:] or v
    return statistics.median(lo), statistics.median(hi)


def cost_summary(results):
    """Per configuration, over its processes: the median and IQR of the per-process medians,
    and the per-round ratio of PyTorch's recorder to memsnap (same stacks, same round)."""
    by = {}
    for r in results:
        case, _, config = r.get("case", "").partition(":")
        if case in ("cost", "cost-async") and r.get("per_event_ns_median") is not None:
            # cost-async's rows keep their route in the name: async-memsnap-python, ...
            by.setdefault(config if case == "cost" else f"async-{config}", []).append(r)
    summary = {}
    for config, runs in by.items():
        medians = [r["per_event_ns_median"] for r in runs]
        q1, q3 = quartiles(medians)
        summary[config] = {"processes": len(runs), "per_event_ns_median": statistics.median(medians),
                           "per_event_ns_q1": q1, "per_event_ns_q3": q3,
                           "per_process_medians": [round(m, 1) for m in medians],
                           "ok": all(r.get("ok") for r in runs)}
    for stacks in ("python", "all"):
        theirs = by.get(f"recorder-{stacks}", [])
        for route, key in (("", "times_memsnap"), ("async-", "times_async_memsnap")):
            ours = by.get(f"{route}memsnap-{stacks}", [])
            ratios = [t["per_event_ns_median"] / m["per_event_ns_median"] for m, t in zip(ours, theirs)
                      if m["per_event_ns_median"] > 0]
            if ratios:
                q1, q3 = quartiles(ratios)
                summary[f"recorder-{stacks}"][f"{key}_median"] = statistics.median(ratios)
                summary[f"recorder-{stacks}"][f"{key}_q1_q3"] = [q1, q3]
    return summary


def case_cost(args):
    """One process: alternating blocks of the same loop, recorded and not."""
    import torch
    mode = os.environ.get("TORCH_BLOCKS_COST", "memsnap")
    sizes = [512 * (1 + (i * 37) % 2048) for i in range(256)]
    n = args.iterations
    cost_loop(torch, n, sizes)  # warm the cache: every later tensor comes from it
    torch.cuda.synchronize()
    # With --isolate the loop's thread gets one core to itself (memsnap's writer, which
    # drains the events the loop records, and CUDA's threads run on the others).
    pinned_cpu, kept_off = pin_main_thread(isolate=True) if args.isolate else (None, [])
    lib = ctypes.CDLL(None)
    switch = getattr(lib, "memsnap_debug_pass_through", None)
    if mode == "memsnap" and switch is None:
        return {"ok": False, "error": "this libmemsnap.so has no memsnap_debug_pass_through (build with --features bench-hooks)"}
    on_ns, off_ns = [], []
    for block in range(args.blocks):
        for recorded in ((True, False) if block % 2 == 0 else (False, True)):
            if mode == "memsnap":
                switch(0 if recorded else 1)
            elif recorded:
                recorder_on(torch, os.environ.get("TORCH_BLOCKS_STACKS", "python"))
            t0 = time.perf_counter_ns()
            cost_loop(torch, n, sizes)
            t1 = time.perf_counter_ns()
            if mode == "memsnap":
                switch(0)
            elif recorded:
                torch.cuda.memory._record_memory_history(enabled=None)
            (on_ns if recorded else off_ns).append((t1 - t0) / (2 * n))
    # Each recorded block is paired with the unrecorded block next to it (same process, same
    # moment): the difference is the cost per event, the ratio the slowdown.
    diffs = [a - b for a, b in zip(on_ns, off_ns)]
    q1, q3 = quartiles(diffs)
    out = {"mode": mode, "per_event_ns_median": statistics.median(diffs), "per_event_ns_min": min(diffs),
           "per_event_ns_max": max(diffs), "blocks": len(diffs), "events_per_block": 2 * n,
           "off_ns_per_event_median": statistics.median(off_ns),
           "per_event_ns_q1": q1, "per_event_ns_q3": q3, "per_event_ns_iqr": q3 - q1,
           "per_event_ns_all": [round(d, 1) for d in diffs],
           "on_off_ratio_median": statistics.median(a / b for a, b in zip(on_ns, off_ns)),
           "pinned_cpu": pinned_cpu, "kept_off": kept_off}
    if mode == "memsnap":
        out.update(memsnap_counts("cost"))
        # The route memsnap took: the tracker's blocks under the caching allocator, the CUDA
        # calls in tensor mode (a figure of the other route would be measured in the wrong row).
        backend = torch.cuda.get_allocator_backend()
        tensor_mode = "cudaMallocAsync" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        line = str(out["torch_allocator"] or "")
        route_ok = (backend == "cudaMallocAsync" and line.startswith("tensors") if tensor_mode else
                    backend == "native" and line.startswith("blocks"))
        out.update(allocator_backend=backend, route_ok=route_ok)
        out["ok"] = out["dropped"] == 0 and out["without_stack"] == 0 and route_ok
    else:
        out["ok"] = True
    return out


CASES = {"compare": case_compare, "expandable": case_compare, "graphs": case_graphs, "step": case_step, "leak": case_leak, "oom": case_oom,
         "cost": case_cost, "cost-async": case_cost}


def run_case(args, name, env_extra, timeout):
    folder = tempfile.mkdtemp(prefix=f"torch-blocks-{name}-")
    env = dict(os.environ)
    env.update(MEMSNAP_FOLDER=folder, PYTHONUNBUFFERED="1")
    env.update(env_extra)
    if env_extra.get("NO_PRELOAD"):
        env.pop("LD_PRELOAD", None)
    else:
        env["LD_PRELOAD"] = os.path.abspath(args.lib)
    cmd = [sys.executable, os.path.abspath(__file__), "--case", name.split(":")[0], "--cli", args.cli,
           "--iterations", str(args.iterations), "--blocks", str(args.blocks)] + (["--isolate"] if args.isolate else [])
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        rec = json.loads(lines[-1][7:]) if lines else {"ok": False, "error": "no result", "rc": p.returncode}
        if not lines:
            rec["stderr"] = p.stderr[-3000:]
    except subprocess.TimeoutExpired:
        rec = {"ok": False, "error": f"timed out after {timeout}s"}
    rec["case"] = name
    rec["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(rec)[:2000], flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--cli", default="memsnap")
    ap.add_argument("--out", default=".")
    ap.add_argument("--case")
    ap.add_argument("--cases", default="compare,expandable,step,leak,oom,cost")
    ap.add_argument("--cost-rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=5000)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--isolate", action="store_true",
                    help="cost cases: the loop's thread pinned to one core, every other thread of the "
                         "process (memsnap's writer included) off that core (machines of 4 CPUs or more)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)  # a folder per library under $OUT, say
    if args.case:
        try:
            rec = CASES[args.case](args)
        except Exception as e:  # the record says what broke
            import traceback
            rec = {"ok": False, "error": repr(e), "trace": traceback.format_exc()[-2000:]}
        print("RESULT " + json.dumps(rec), flush=True)
        return
    results = []
    wanted = args.cases.split(",")
    if "compare" in wanted:
        results.append(run_case(args, "compare", {}, 120))
    if "expandable" in wanted:
        results.append(run_case(args, "expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, 120))
    if "graphs" in wanted:
        results.append(run_case(args, "graphs", {}, 400))
    if "step" in wanted:
        results.append(run_case(args, "step", {}, 180))
    if "leak" in wanted:
        results.append(run_case(args, "leak", {}, 180))
    if "oom" in wanted:
        results.append(run_case(args, "oom", {}, 180))
    costs = [c for c in ("cost", "cost-async") if c in wanted]
    for r in range(args.cost_rounds if costs else 0):
        # Each round runs every configuration once, the routes side by side.
        if "cost" in wanted:
            for stacks in ("none", "python", "all"):
                results.append(run_case(args, f"cost:memsnap-{stacks}", {"MEMSNAP_STACKS": stacks, "TORCH_BLOCKS_COST": "memsnap"}, 150))
        if "cost-async" in wanted:
            for stacks in ("none", "python", "all"):
                results.append(run_case(args, f"cost-async:memsnap-{stacks}",
                                        {"MEMSNAP_STACKS": stacks, "TORCH_BLOCKS_COST": "memsnap",
                                         "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, 150))
        if "cost" in wanted:
            for stacks in ("none", "python", "all"):
                results.append(run_case(args, f"cost:recorder-{stacks}", {"NO_PRELOAD": "1", "TORCH_BLOCKS_COST": "recorder", "TORCH_BLOCKS_STACKS": stacks}, 150))
    with open(os.path.join(args.out, "torch_blocks.json"), "w") as f:
        json.dump(results, f, indent=1)
    if costs:
        summary = cost_summary(results)
        with open(os.path.join(args.out, "torch_blocks_cost.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print("\ncost per event, ns over not recording (median over processes of each process's median of paired blocks);"
              " async-: tensor mode (cudaMallocAsync backend), the recorder on the caching allocator")
        print(f"{'configuration':<22} {'processes':>9} {'median':>8} {'IQR':>17}  recorder / memsnap (tensor mode)")
        for config, c in summary.items():
            ratio, ratio_async = c.get("times_memsnap_median"), c.get("times_async_memsnap_median")
            ratios = " ".join(text for text in (ratio is not None and f"{ratio:.1f}x",
                                                ratio_async is not None and f"({ratio_async:.1f}x)") if text)
            print(f"{config:<22} {c['processes']:>9} {c['per_event_ns_median']:>8.1f} "
                  f"{c['per_event_ns_q1']:>8.1f}-{c['per_event_ns_q3']:<8.1f}  "
                  f"{ratios}{'' if c['ok'] else '  NOT OK (lost events or the wrong route: void)'}")
    print("\ncase                     ok   key figures")
    for r in results:
        names = ("problem_count", "pool_id_difference_count", "private_pools_torch", "memory_allocated", "memsnap_live_block_bytes", "leak_named_first",
                 "memsnap_inactive_bytes", "torch_inactive_bytes", "per_event_ns_median", "dropped", "without_stack")
        # (the step case's figures are per moment: forward, after)
        for moment, rec in [("", r)] + [(f" {m}", r[m]) for m in ("forward", "after") if isinstance(r.get(m), dict)]:
            keys = {k: rec.get(k) for k in names if k in rec}
            if keys or not moment:
                print(f"{r['case'] + moment:<24} {str(rec.get('ok')):<5} {keys}")


if __name__ == "__main__":
    main()
