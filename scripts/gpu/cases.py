"""Validation cases: each starts a workload with libmemsnap.so preloaded, then checks memsnap's
snapshots against the workload's ground truth. Runs WITHOUT the preload itself.

    python3 cases.py CASE --root DIR --lib LIB [--cli CLI] [--bin EXE] [--timeout S]

Works in DIR/CASE and writes DIR/CASE/result.json (one case's record, see snaputil.Result) whatever
happens, and exits 0 when the
case passed or was skipped, 1 otherwise. validate.sh runs every case and merges the records.
"""
import argparse
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import snaputil as su  # noqa: E402
from snaputil import MIB, log  # noqa: E402

WORKLOADS = os.path.join(HERE, "workloads.py")
SAFE_ENV = {  # NVLink multicast must stay off on the lent machines
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
}


# ----------------------------------------------------------------------------------------------
# Running a workload


CURRENT_CHILD = []  # the running workload, killed (with its process group) if this driver is stopped


def on_term(signum, frame):
    for p in CURRENT_CHILD:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
    raise SystemExit(124)


def run_child(r, cmd, case_dir, lib, env_extra=None, timeout=120, preload=True, tag="child"):
    """Runs `cmd` with the preload and MEMSNAP_FOLDER=case_dir/snaps. Returns (rc, folder)."""
    folder = os.path.join(case_dir, "snaps")
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ)
    env.update(SAFE_ENV)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING", "MEMSNAP_STACKS",
              "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        env.pop(k, None)
    if preload:
        env["LD_PRELOAD"] = lib
    env["MEMSNAP_FOLDER"] = folder
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [os.path.join(os.getcwd(), "scripts"), HERE, env.get("PYTHONPATH", "")] if p)
    env.update(env_extra or {})
    out_path = os.path.join(case_dir, f"{tag}.stdout.txt")
    err_path = os.path.join(case_dir, f"{tag}.stderr.txt")
    log(f"  $ {' '.join(f'{k}={v}' for k, v in (env_extra or {}).items())} {' '.join(cmd)}")
    t0 = time.time()
    rc = None
    with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
        p = subprocess.Popen(cmd, env=env, stdout=fo, stderr=fe, start_new_session=True)
        CURRENT_CHILD.append(p)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            r.error(f"{tag} timed out after {timeout}s: {' '.join(cmd)}")
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()
            rc = "timeout"
        finally:
            CURRENT_CHILD.remove(p)
    dt = time.time() - t0
    out_tail = tail(out_path, 3000)
    err_tail = tail(err_path, 6000)
    log(f"  {tag} rc={rc} in {dt:.1f}s")
    if out_tail.strip():
        log(f"  --- {tag} stdout (tail) ---\n{out_tail}")
    if err_tail.strip():
        log(f"  --- {tag} stderr (tail) ---\n{err_tail}")
    memsnap_lines = [ln for ln in read_text(err_path).splitlines() if "memsnap" in ln.lower()][:30]
    r.details.setdefault("children", []).append({
        "tag": tag, "cmd": cmd, "env": env_extra or {}, "rc": rc, "seconds": round(dt, 2),
        "stderr_tail": err_tail[-2000:], "memsnap_stderr_lines": memsnap_lines,
    })
    return rc, folder


def tail(path, n):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def read_text(path):
    try:
        with open(path, "rb") as f:
            return f.read(2_000_000).decode("utf-8", "replace")
    except OSError:
        return ""


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"no truth file {path}: {e!r}"}


def record_snapshots(r, folder):
    files = su.list_snapshots(folder)
    r.snapshots = [{"file": p, "bytes": os.path.getsize(p), "name": su.parse_name(p)} for p in files]
    r.measured["files_per_pid"] = su.count_per_pid(folder)
    return files


def check_structure(r, path, snap):
    probs = su.structure_problems(snap)
    r.check(f"format/consistency of {os.path.basename(path)}", not probs, probs or None)


def check_meta(r, snap, label):
    meta = su.memsnap_meta(snap)
    r.details.setdefault("memsnap_meta", {})[label] = {
        k: v for k, v in meta.items() if len(json.dumps(v, default=str)) < 3000}
    dropped = meta.get("dropped_events")
    if isinstance(dropped, dict):
        dropped = sum(v for v in dropped.values() if isinstance(v, int))
    r.check(f"{label}: no dropped events (memsnap.dropped_events)", dropped in (0, None),
            {"dropped_events": meta.get("dropped_events")}, hard=False)


def truth_ok(r, truth):
    return r.check("workload ran", truth.get("ok") is True, truth.get("error"))


def load_dump(r, truth, label="signal dump"):
    dump = truth.get("dump") or {}
    r.measured["dump_wait_s"] = dump.get("wait_s")
    if not r.check(f"{label}: file appeared after SIGUSR1", dump.get("file"), dump):
        return None, None
    try:
        snap = su.load_snapshot(dump["file"])
    except Exception as e:  # noqa: BLE001
        r.check(f"{label}: loads with pickle", False, repr(e))
        return None, None
    check_structure(r, dump["file"], snap)
    check_meta(r, snap, label)
    r.measured["signal_snapshot"] = su.summarize(snap)
    return dump["file"], snap


def alloc_api(snap):
    """(device, addr) -> user_metadata of the alloc event that made each live allocation."""
    return {k: str(e.get("user_metadata", "")) for k, e in su.live_from_trace(snap).items()}


def only_pid(r, folder, pid, label="files come only from the workload process"):
    counts = su.count_per_pid(folder)
    r.check(label, set(counts) <= {str(pid)}, counts)


# ----------------------------------------------------------------------------------------------
# a. CUDA C++


def case_cuda(r, a):
    if not a.bin or not os.path.exists(a.bin):
        r.error(f"test binary missing: {a.bin} (did nvcc fail? see log)")
        return
    case_dir = a.work
    manifest_path = os.path.join(case_dir, "manifest.json")
    rc, folder = run_child(r, [a.bin, manifest_path], case_dir, a.lib, {"MEMSNAP_STACKS": "all"},
                           timeout=a.timeout)
    r.check("program exited 0", rc == 0, rc)
    files = record_snapshots(r, folder)
    m = read_json(manifest_path)
    if not r.check("manifest written", "live" in m, m.get("error")):
        return
    r.details["manifest"] = m
    pid = m["pid"]
    only_pid(r, folder, pid)
    sig = m["signal"]
    r.check("SIGUSR1 handler installed by memsnap", sig["handler_installed"], sig)
    sig_path = os.path.join(folder, sig["file"]) if sig.get("file") else None
    r.measured["signal_wait_s"] = sig.get("wait_s")
    if not r.check("signal file appeared", sig_path and os.path.exists(sig_path), sig):
        return
    snap = su.load_snapshot(sig_path)
    check_structure(r, sig_path, snap)
    check_meta(r, snap, "signal dump")
    r.measured["signal_snapshot"] = su.summarize(snap)
    live = su.live_blocks(snap)
    by_addr = {}
    for b in live:
        by_addr.setdefault(b["addr"], []).append(b)
    dup = {hex(k): len(v) for k, v in by_addr.items() if len(v) > 1}
    r.check("no address live twice", not dup, dup or None)
    events = [e for _, e in su.all_events(snap)]
    have_frames = su.frames_present(snap) > 0
    r.check("frames recorded (MEMSNAP_STACKS=all)", have_frames,
            None if have_frames else "no frames in any event or block (native stacks not landed yet?)", hard=False)
    for exp in m["live"] + m["freed"]:
        name, addr, size = exp["name"], exp["addr"], exp["size"]
        allocs = [e for e in events if e.get("action") == "alloc" and e.get("addr") == addr]
        r.check(f"{name}: alloc event with size {size}", any(e.get("size") == size for e in allocs),
                [{k: e.get(k) for k in ("size", "stream", "user_metadata")} for e in allocs])
        if exp["stream"]:
            r.check(f"{name}: alloc event on its stream", any(e.get("stream") == exp["stream"] for e in allocs),
                    {"expected": exp["stream"], "seen": [e.get("stream") for e in allocs]}, hard=False)
        r.details.setdefault("api_names", {})[name] = sorted({str(e.get("user_metadata")) for e in allocs})
        blocks = by_addr.get(addr, [])
        if exp in m["live"]:
            r.check(f"{name}: live exactly once", len(blocks) == 1, len(blocks))
            r.check(f"{name}: requested_size == {size}", [b["requested"] for b in blocks] == [size],
                    [{"requested": b["requested"], "size": b["size"]} for b in blocks])
            frames = (blocks[0]["frames"] if blocks else []) or (allocs[-1].get("frames") if allocs else [])
        else:
            r.check(f"{name}: absent after its free", not blocks, len(blocks))
            kinds = [e.get("action") for e in events if e.get("addr") == addr]
            r.check(f"{name}: free_requested + free_completed recorded",
                    "free_requested" in kinds and "free_completed" in kinds, kinds)
            frames = allocs[-1].get("frames") if allocs else []
        if have_frames:
            r.check(f"{name}: frames name {exp['fn']}", su.frames_mention(frames, exp["fn"]),
                    su.frame_names(frames)[:12])
    oom = m["oom"]
    r.check("test really hit OOM (cudaErrorMemoryAllocation)", oom["error"] == 2, oom)
    ooms = [e for e in events if e.get("action") == "oom"]
    match = [e for e in ooms if e.get("size") == oom["request"]]
    r.measured["oom"] = {"request": oom["request"], "free_before": oom["free_before"],
                         "events": [{k: e.get(k) for k in ("size", "device_free", "user_metadata")} for e in ooms]}
    r.check("exactly one oom event with size == request", len(match) == 1, r.measured["oom"]["events"])
    if match:
        df = match[0].get("device_free")
        rel = abs(df - oom["free_before"]) / max(1, oom["free_before"]) if isinstance(df, int) else None
        r.measured["oom"]["device_free_rel_err"] = rel
        r.check("oom device_free within 5% of cudaMemGetInfo", rel is not None and rel <= 0.05,
                {"device_free": df, "cudaMemGetInfo_free": oom["free_before"]})
    r.check("an *oom* file was written", su.files_by(folder, reason="oom"), None, hard=False)
    exits = su.files_by(folder, reason="exit")
    if r.check("an *exit* file was written", len(exits) == 1, [os.path.basename(p) for p in exits]):
        ex = su.load_snapshot(exits[0])
        check_structure(r, exits[0], ex)
        ex_live = {b["addr"] for b in su.live_blocks(ex)}
        r.check("exit snapshot still holds the live allocations", all(e["addr"] in ex_live for e in m["live"]),
                None, hard=False)
    for p in files:
        if p not in exits and p != sig_path:
            try:
                check_structure(r, p, su.load_snapshot(p))
            except Exception as e:  # noqa: BLE001
                r.check(f"{os.path.basename(p)} loads", False, repr(e))


# ----------------------------------------------------------------------------------------------
# b, c, d. PyTorch training with each allocator


def torch_train(r, a, env, tag="torch"):
    truth_path = os.path.join(a.work, "truth.json")
    rc, folder = run_child(r, [sys.executable, WORKLOADS, "torch_train", truth_path], a.work, a.lib, env,
                           timeout=a.timeout, tag=tag)
    r.check("workload exited 0", rc == 0, rc)
    truth = read_json(truth_path)
    r.details["truth"] = {k: v for k, v in truth.items() if k != "torch_segments"}
    record_snapshots(r, folder)
    if "pid" in truth:
        only_pid(r, folder, truth["pid"])
    truth_ok(r, truth)
    path, snap = load_dump(r, truth)
    for k in ("memory_allocated", "memory_reserved", "known_live_bytes"):
        r.measured[k] = truth.get(k)
    if snap is not None:
        live = su.live_blocks(snap)
        live_bytes = sum(b["size"] for b in live)
        r.measured["memsnap_live_bytes"] = live_bytes
        r.check("memsnap live bytes >= bytes of tensors known alive",
                live_bytes >= (truth.get("known_live_bytes") or 0),
                {"memsnap": live_bytes, "known": truth.get("known_live_bytes")})
        exits = su.files_by(folder, reason="exit")
        r.check("an *exit* file was written", len(exits) == 1, [os.path.basename(p) for p in exits])
        for p in exits:
            try:
                check_structure(r, p, su.load_snapshot(p))
            except Exception as e:  # noqa: BLE001
                r.check(f"{os.path.basename(p)} loads", False, repr(e))
    return truth, snap


def case_torch_caching(r, a):
    truth, snap = torch_train(r, a, {})
    if snap is None:
        return
    tsegs = truth.get("torch_segments") or []
    if not r.check("torch.cuda.memory._snapshot() worked", truth.get("torch_segments") is not None,
                   truth.get("torch_snapshot_error")):
        return
    msegs = {}
    for seg in snap.get("segments", []):
        msegs[(seg.get("device"), seg.get("address"))] = seg
    api = alloc_api(snap)
    missing, matched = [], 0
    for t in tsegs:
        m = msegs.get((t["device"], t["address"]))
        ok = m is not None and (m.get("total_size") == t["total_size"]
                                or any(b.get("requested_size") == t["total_size"] for b in m.get("blocks", [])))
        if ok:
            matched += 1
        else:
            missing.append({"address": t["address"], "total_size": t["total_size"],
                            "memsnap": None if m is None else m.get("total_size")})
    torch_bytes = sum(t["total_size"] for t in tsegs)
    torch_keys = {(t["device"], t["address"]) for t in tsegs}
    extra = [s for k, s in msegs.items() if k not in torch_keys]
    extra_bytes = sum(s.get("total_size", 0) for s in extra)
    r.measured.update({
        "torch_segments": len(tsegs), "torch_segment_bytes": torch_bytes, "matched": matched,
        "memsnap_segments": len(msegs), "memsnap_extra_segments": len(extra),
        "memsnap_extra_bytes": extra_bytes,
        "memsnap_extra_examples": sorted(
            ({"address": s.get("address"), "size": s.get("total_size"),
              "api": api.get((s.get("device"), s.get("address")), "")} for s in extra),
            key=lambda x: -x["size"])[:10],
    })
    r.check("torch segments exist", len(tsegs) > 0, len(tsegs))
    r.check("every PyTorch segment (address, size) is a live memsnap segment", not missing,
            {"missing": missing[:10], "n_missing": len(missing)})


def case_torch_async(r, a):
    truth, snap = torch_train(r, a, {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    if snap is None:
        return
    api = alloc_api(snap)
    live = su.live_blocks(snap)
    has_meta = any(v for v in api.values())
    async_live = [b for b in live if api.get((b["device"], b["addr"]), "") in su.ASYNC_APIS] if has_meta else live
    async_bytes = sum(b["requested"] for b in async_live)
    allocated = truth.get("memory_allocated") or 0
    diff = async_bytes - allocated
    counts = su.action_counts(snap)
    r.measured.update({
        "memsnap_async_live_requested_bytes": async_bytes, "memsnap_async_live_blocks": len(async_live),
        "memsnap_all_live_requested_bytes": sum(b["requested"] for b in live),
        "torch_memory_allocated": allocated, "difference_bytes": diff,
        "selected_by": "user_metadata" if has_meta else "all live blocks (no user_metadata)",
        "alloc_events": counts.get("alloc", 0), "apis": su.metadata_counts(snap),
    })
    r.check("tensor-level events (>= 100 allocs)", counts.get("alloc", 0) >= 100, counts)
    r.check("memsnap cudaMallocAsync live bytes == torch.cuda.memory_allocated() (+-max(2 MiB, 1%))",
            abs(diff) <= max(2 * MIB, allocated // 100), {"memsnap": async_bytes, "torch": allocated, "diff": diff})
    check_script_frames(r, snap, truth)


def check_script_frames(r, snap, truth):
    script = os.path.basename(truth.get("script") or WORKLOADS)
    try:
        with open(WORKLOADS) as f:
            src = f.read().splitlines()
    except OSError:
        src = []
    n_frames = su.frames_present(snap)
    if not r.check("events carry frames (MEMSNAP_STACKS=all)", n_frames > 0, n_frames, hard=False):
        return
    hits, bad_lines, funcs = 0, [], set()
    for _, e in su.all_events(snap):
        for fr in e.get("frames") or []:
            if str(fr.get("filename", "")).endswith(script):
                hits += 1
                funcs.add(fr.get("name"))
                ln = fr.get("line")
                if not (isinstance(ln, int) and 1 <= ln <= len(src) and src[ln - 1].strip()):
                    if len(bad_lines) < 10:
                        bad_lines.append(ln)
    r.measured["script_frames"] = hits
    r.details["script_functions"] = sorted(str(x) for x in funcs)
    r.check(f"Python frames name {script}", hits > 0, hits)
    if hits:
        r.check(f"{script} frames carry real source lines", not bad_lines, bad_lines)
        r.check("frames name train_step", "train_step" in funcs, sorted(str(x) for x in funcs), hard=False)


def case_torch_expandable(r, a):
    truth, snap = torch_train(r, a, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    if snap is None:
        return
    counts = su.action_counts(snap)
    live_bytes = r.measured.get("memsnap_live_bytes") or 0
    reserved = truth.get("memory_reserved") or 0
    r.measured.update({"actions": counts, "apis": su.metadata_counts(snap), "torch_memory_reserved": reserved})
    r.check("segment_map events recorded", counts.get("segment_map", 0) > 0, counts)
    r.check("memsnap live bytes >= 95% of torch.cuda.memory_reserved()", live_bytes >= 0.95 * reserved,
            {"memsnap": live_bytes, "reserved": reserved})
    tsegs = truth.get("torch_segments") or []
    mranges = {(s.get("address"), s.get("total_size")) for s in snap.get("segments", [])}
    unmatched = [(t["address"], t["total_size"]) for t in tsegs if (t["address"], t["total_size"]) not in mranges]
    r.check("PyTorch's mapped ranges equal memsnap's segments", not unmatched,
            {"unmatched": unmatched[:10], "torch": len(tsegs)}, hard=False)


def case_torch_nocache(r, a):
    truth, snap = torch_train(r, a, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    if snap is None:
        return
    counts = su.action_counts(snap)
    r.measured.update({"actions": counts, "apis": su.metadata_counts(snap)})
    r.check("tensor-level events (>= 100 allocs)", counts.get("alloc", 0) >= 100, counts)


# ----------------------------------------------------------------------------------------------
# e. JAX and CuPy


def case_jax(r, a):
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    framework_case(r, a, "jax", env)


def case_cupy(r, a):
    framework_case(r, a, "cupy", {})


def framework_case(r, a, mode, env):
    truth_path = os.path.join(a.work, "truth.json")
    rc, folder = run_child(r, [sys.executable, WORKLOADS, mode, truth_path], a.work, a.lib, env,
                           timeout=a.timeout, tag=mode)
    r.check("workload exited 0", rc == 0, rc)
    truth = read_json(truth_path)
    r.details["truth"] = truth
    record_snapshots(r, folder)
    if not truth_ok(r, truth):
        return
    if mode == "jax":
        r.check("JAX runs on the GPU", truth.get("backend") in ("gpu", "cuda"), truth.get("backend"))
    only_pid(r, folder, truth["pid"], "files come only from the process that used CUDA (children wrote none)")
    path, snap = load_dump(r, truth)
    if snap is None:
        return
    live = su.live_blocks(snap)
    live_bytes = sum(b["size"] for b in live)
    counts = su.action_counts(snap)
    r.measured.update({"memsnap_live_bytes": live_bytes, "known_live_bytes": truth.get("known_live_bytes"),
                       "actions": counts, "apis": su.metadata_counts(snap)})
    r.check("allocations seen", counts.get("alloc", 0) + counts.get("segment_map", 0) > 0, counts)
    r.check("memsnap live bytes >= bytes of arrays known alive", live_bytes >= (truth.get("known_live_bytes") or 1),
            {"memsnap": live_bytes, "known": truth.get("known_live_bytes")})
    if mode == "cupy":
        r.measured["pool_total_bytes"] = truth.get("pool_total_bytes")
        r.check("memsnap live bytes >= CuPy pool total_bytes()", live_bytes >= (truth.get("pool_total_bytes") or 0),
                {"memsnap": live_bytes, "pool_total": truth.get("pool_total_bytes")}, hard=False)
    exits = su.files_by(folder, reason="exit")
    r.check("an *exit* file was written", len(exits) == 1, [os.path.basename(p) for p in exits])
    for p in exits:
        try:
            check_structure(r, p, su.load_snapshot(p))
        except Exception as e:  # noqa: BLE001
            r.check(f"{os.path.basename(p)} loads", False, repr(e))


# ----------------------------------------------------------------------------------------------
# f. OOM inside a PyTorch step


def case_torch_oom(r, a):
    truth_path = os.path.join(a.work, "truth.json")
    rc, folder = run_child(r, [sys.executable, WORKLOADS, "torch_oom", truth_path], a.work, a.lib, {},
                           timeout=a.timeout, tag="torch_oom")
    r.check("workload exited 0", rc == 0, rc)
    truth = read_json(truth_path)
    r.details["truth"] = truth
    record_snapshots(r, folder)
    if not truth_ok(r, truth):
        return
    r.check("torch.cuda.OutOfMemoryError raised", truth.get("raised"), truth.get("exception"))
    at_except = truth.get("oom_files_at_except") or []
    r.measured["oom_file_at_except"] = bool(at_except)
    r.measured["oom_file_later_wait_s"] = truth.get("oom_file_later_wait_s")
    r.check("the *oom* file exists when the exception reaches Python", bool(at_except),
            {"at_except": at_except, "later": truth.get("oom_file_later"),
             "later_wait_s": truth.get("oom_file_later_wait_s")})
    path = (at_except or [truth.get("oom_file_later")])[0]
    if not path:
        return
    snap = su.load_snapshot(path)
    check_structure(r, path, snap)
    check_meta(r, snap, "oom dump")
    ooms = [e for _, e in su.all_events(snap) if e.get("action") == "oom"]
    req = truth["oom_request"]
    r.measured["oom_events"] = [{k: e.get(k) for k in ("size", "device_free", "user_metadata")} for e in ooms]
    match = [e for e in ooms if e.get("size") == req]
    r.check("oom event with size == the tensor's bytes", match, {"request": req, "events": r.measured["oom_events"]})
    if match:
        free = truth["mem_get_info"]["free"]
        df = match[0].get("device_free")
        rel = abs(df - free) / max(1, free) if isinstance(df, int) else None
        r.check("oom device_free within 5% of torch.cuda.mem_get_info() before the step", rel is not None and rel <= 0.05,
                {"device_free": df, "mem_get_info_free": free}, hard=False)
    r.check("training continued after the OOM", truth.get("continued_after_oom"), None, hard=False)


# ----------------------------------------------------------------------------------------------
# g. torchrun, two ranks


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_ddp(r, a):
    ngpu = int(os.environ.get("NGPU", "0") or 0)
    r.measured["gpus"] = ngpu
    if ngpu < 2:
        r.skip(f"needs 2 GPUs, {ngpu} visible")
        return
    truth_path = os.path.join(a.work, "truth.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           f"--master_port={free_port()}", WORKLOADS, "ddp", truth_path]
    rc, folder = run_child(r, cmd, a.work, a.lib, {"OMP_NUM_THREADS": "1"}, timeout=a.timeout, tag="torchrun")
    r.check("torchrun exited 0", rc == 0, rc)
    record_snapshots(r, folder)
    files = su.list_snapshots(folder)
    infos = {p: su.parse_name(p) for p in files}
    r.details["files"] = {os.path.basename(p): i for p, i in infos.items()}
    pids = set()
    for rank in (0, 1):
        t = read_json(os.path.join(a.work, f"truth_r{rank}.json"))
        r.details[f"truth_r{rank}"] = t
        if not r.check(f"rank {rank} ran", t.get("ok") is True, t.get("error")):
            continue
        pids.add(t["pid"])
        r.check(f"rank {rank} all_reduce correct", t.get("allreduce_value") == t.get("allreduce_expected"),
                [t.get("allreduce_value"), t.get("allreduce_expected")])
        mine = [p for p, i in infos.items() if i and i["rank"] == rank and i["reason"] == "exit"]
        if not r.check(f"exactly one exit file named r{rank}", len(mine) == 1, [os.path.basename(p) for p in mine]):
            continue
        r.check(f"r{rank} file comes from rank {rank}'s pid", infos[mine[0]]["pid"] == t["pid"],
                {"file_pid": infos[mine[0]]["pid"], "rank_pid": t["pid"]})
        snap = su.load_snapshot(mine[0])
        check_structure(r, mine[0], snap)
        s = su.summarize(snap)
        r.measured[f"r{rank}"] = s
        r.check(f"r{rank} has events", s["events"] > 0, s["actions"])
        dev = t.get("device", rank)
        on_dev = [seg for seg in snap.get("segments", []) if seg.get("device") == dev]
        r.check(f"r{rank} segments on device {dev}", on_dev, len(on_dev), hard=False)
    other = {i["pid"] for i in infos.values() if i and i["pid"] not in pids}
    r.check("no file from the launcher or other processes", not other, sorted(other))
    unparsed = [os.path.basename(p) for p, i in infos.items() if i is None]
    r.check("file names follow memsnap-...-r{rank}-p{pid}-{label}-{seq}.pickle", not unparsed, unparsed)


# ----------------------------------------------------------------------------------------------
# h. PyTorch's own tooling on every snapshot


def case_memviz(r, a):
    files = sorted(glob.glob(os.path.join(a.root, "*", "snaps", "*.pickle")))
    r.measured["files"] = len(files)
    if not r.check("snapshots to check exist", files, len(files)):
        return
    try:
        from torch.cuda import _memory_viz as mv
    except Exception as e:  # noqa: BLE001
        r.error(f"cannot import torch.cuda._memory_viz: {e!r}")
        return
    checker = os.path.join(os.getcwd(), "tests", "python", "check_snapshot.py")
    r.details["check_snapshot_py"] = checker if os.path.exists(checker) else "absent (skipped)"
    cli_summary = a.cli and os.path.exists(a.cli) and summary_supported(a.cli)
    r.details["memsnap_summary"] = "used" if cli_summary else "absent or unsupported (skipped)"
    per_file = {}
    for p in files:
        rel = os.path.relpath(p, a.root)
        info = per_file[rel] = {"bytes": os.path.getsize(p)}
        t0 = time.time()
        try:
            snap = su.load_snapshot(p, retries=2)
        except Exception as e:  # noqa: BLE001
            r.check(f"{rel}: loads", False, repr(e))
            continue
        for fn_name in ("segsum", "trace"):
            try:
                out = getattr(mv, fn_name)(snap)
                r.check(f"{rel}: _memory_viz.{fn_name}", isinstance(out, str), None)
                info[fn_name + "_chars"] = len(out)
            except Exception as e:  # noqa: BLE001
                r.check(f"{rel}: _memory_viz.{fn_name}", False, f"{type(e).__name__}: {e}"[:500])
        try:
            html = mv.trace_plot(snap)
            r.check(f"{rel}: _memory_viz.trace_plot", isinstance(html, str) and len(html) > 0, None)
            info["trace_plot_chars"] = len(html) if isinstance(html, str) else None
        except Exception as e:  # noqa: BLE001
            r.check(f"{rel}: _memory_viz.trace_plot", False, f"{type(e).__name__}: {e}"[:500])
        try:
            probs = su.opcode_problems(p)
            if probs is None:
                info["opcodes"] = "skipped (file too large)"
            else:
                r.check(f"{rel}: pickle opcodes the browser viewer accepts", not probs, probs or None)
        except Exception as e:  # noqa: BLE001
            r.check(f"{rel}: pickle opcodes readable", False, repr(e))
        if os.path.exists(checker):
            rc, out = run_quiet([sys.executable, checker, p], 120)
            r.check(f"{rel}: tests/python/check_snapshot.py", rc == 0, out[-1500:] if rc != 0 else None)
        if cli_summary:
            rc, out = run_quiet([a.cli, "summary", p, "--json"], 60, stdout_only=True)
            parsed = None
            try:
                parsed = json.loads(out)
            except Exception:  # noqa: BLE001
                try:
                    parsed = json.loads(out[out.index("{"):]) if "{" in out else None
                except Exception:  # noqa: BLE001
                    parsed = None
            r.check(f"{rel}: memsnap summary --json", rc == 0 and parsed is not None, out[-800:] if rc else None)
            if parsed is not None:
                info["summary"] = {k: v for k, v in parsed.items() if len(json.dumps(v, default=str)) < 500} \
                    if isinstance(parsed, dict) else None
        info["seconds"] = round(time.time() - t0, 2)
    r.details["files"] = per_file


def summary_supported(cli):
    rc, out = run_quiet([cli, "summary", "--help"], 30)
    return rc == 0


def run_quiet(cmd, timeout, stdout_only=False):
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=timeout)
        if stdout_only and p.returncode == 0:
            return p.returncode, p.stdout.decode("utf-8", "replace")
        return p.returncode, (p.stdout + p.stderr).decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        return "timeout", f"timed out after {timeout}s"
    except OSError as e:
        return "oserror", repr(e)


CASES = {
    "a_cuda_static": case_cuda,
    "a_cuda_shared": case_cuda,
    "b_torch_caching": case_torch_caching,
    "c_torch_async": case_torch_async,
    "d_torch_expandable": case_torch_expandable,
    "d_torch_nocache": case_torch_nocache,
    "e_jax": case_jax,
    "e_cupy": case_cupy,
    "f_torch_oom": case_torch_oom,
    "g_torchrun": case_ddp,
    "h_memviz": case_memviz,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--root", required=True, help="work folder holding one folder per case")
    ap.add_argument("--lib", required=True)
    ap.add_argument("--cli", default="")
    ap.add_argument("--bin", default="")
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    a.root = os.path.abspath(a.root)
    a.work = os.path.join(a.root, a.case)
    shutil.rmtree(a.work, ignore_errors=True)  # a rerun in the same work folder starts clean
    os.makedirs(a.work, exist_ok=True)
    a.lib = os.path.abspath(a.lib)
    a.cli = os.path.abspath(a.cli) if a.cli else ""
    r = su.Result(a.case)
    log(f"== case {a.case}")
    signal.signal(signal.SIGTERM, on_term)
    try:
        if a.case != "h_memviz" and not os.path.exists(a.lib):
            r.error(f"{a.lib} does not exist: build libmemsnap.so and carry target/release over")
        else:
            CASES[a.case](r, a)
    except SystemExit:
        r.error("stopped by SIGTERM (the case's time limit in validate.sh)")
    except Exception:  # noqa: BLE001
        r.error(su.exc_text())
    d = r.write(os.path.join(a.work, "result.json"))
    sys.exit(0 if d["ok"] else 1)


if __name__ == "__main__":
    main()
