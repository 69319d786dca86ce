"""Shared helpers for the GPU validation scripts: snapshot files, result records, light format checks.

Imports nothing beyond the standard library, so the case drivers (which run without the preload)
and the workloads (which run with it) can both use it.
"""
import ctypes
import json
import os
import pickle
import pickletools
import re
import signal
import sys
import time
import traceback

# memsnap-{exe}-{host}-r{rank}-p{pid}-{label}-{seq}.pickle: exe and host may hold dashes,
# so the name is matched from the right. {label} is the tag of a tagged dump, step<N> for a
# step snapshot, else the reason.
SNAP_RE = re.compile(
    r"^memsnap-(?P<head>.*)-r(?P<rank>-?\d+|[A-Za-z_]*)-p(?P<pid>\d+)-(?P<label>[A-Za-z0-9_.-]+)-(?P<seq>\d+)\.pickle$"
)
ASYNC_APIS = ("cudaMallocAsync", "cuMemAllocAsync", "cudaMallocFromPoolAsync", "cuMemAllocFromPoolAsync")
ACTIVE_STATES = ("active_allocated", "active_pending_free")
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
# Opcodes the browser viewer's unpickler accepts (docs/FORMAT.md#opcodes-the-viewer-accepts).
JS_OPCODES = {
    "PROTO", "STOP", "MARK", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "SETITEM", "SETITEMS",
    "DICT", "APPEND", "APPENDS", "LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE",
    "NEWTRUE", "NEWFALSE", "BININT1", "BININT2", "BININT", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE", "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET",
    "LONG_BINGET", "FRAME",
}
MIB = 1 << 20
GIB = 1 << 30


def log(*args):
    print(*args, flush=True)


# ----------------------------------------------------------------------------------------------
# Result records


class Result:
    """One case: named checks (hard ones decide `ok`, soft ones are warnings), measured numbers."""

    def __init__(self, name):
        self.name = name
        self.checks = []
        self.measured = {}
        self.details = {}
        self.errors = []
        self.snapshots = []
        self.skipped = None
        self.t0 = time.time()

    def check(self, name, cond, detail=None, hard=True):
        ok = bool(cond)
        self.checks.append({"name": name, "ok": ok, "hard": hard, "detail": jsonable(detail)})
        tag = "PASS" if ok else ("FAIL" if hard else "WARN")
        log(f"  [{tag}] {self.name}: {name}" + (f" -- {short(detail)}" if detail is not None else ""))
        return ok

    def error(self, text):
        self.errors.append(str(text)[-4000:])
        log(f"  [ERROR] {self.name}: {short(text, 2000)}")

    def skip(self, why):
        self.skipped = why
        log(f"  [SKIP] {self.name}: {why}")

    def ok(self):
        if self.skipped is not None:
            return True
        if self.errors:
            return False
        if not self.checks:
            return False
        return all(c["ok"] for c in self.checks if c["hard"])

    def to_dict(self):
        status = "skip" if self.skipped is not None else ("pass" if self.ok() else "fail")
        return {
            "name": self.name,
            "ok": self.ok(),
            "status": status,
            "skip_reason": self.skipped,
            "duration_s": round(time.time() - self.t0, 3),
            "checks": self.checks,
            "warnings": [c["name"] for c in self.checks if not c["ok"] and not c["hard"]],
            "failed": [c["name"] for c in self.checks if not c["ok"] and c["hard"]],
            "measured": jsonable(self.measured),
            "details": jsonable(self.details),
            "error": "\n".join(self.errors) if self.errors else None,
            "snapshots": self.snapshots,
        }

    def write(self, path):
        d = self.to_dict()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(d, f, indent=1, default=str)
        os.replace(tmp, path)
        log(f"== {self.name}: {d['status'].upper()} ({len(d['failed'])} failed, {len(d['warnings'])} warnings)")
        return d


def jsonable(x):
    try:
        json.dumps(x, default=str)
        return x
    except Exception:
        return repr(x)


def short(x, n=300):
    s = x if isinstance(x, str) else json.dumps(jsonable(x), default=str)
    return s if len(s) <= n else s[: n - 3] + "..."


def exc_text():
    return traceback.format_exc()[-4000:]


# ----------------------------------------------------------------------------------------------
# Snapshot files


def parse_name(name):
    m = SNAP_RE.match(os.path.basename(name))
    if not m:
        return None
    d = m.groupdict()
    rank = int(d["rank"]) if d["rank"].lstrip("-").isdigit() else None
    label = d["label"]
    reason = "step" if re.fullmatch(r"step\d+", label) else label
    return {"rank": rank, "pid": int(d["pid"]), "reason": reason, "label": label, "seq": int(d["seq"])}


def list_snapshots(folder):
    """Finished snapshot files (temporary files of a dump in progress are left out)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(os.path.join(folder, n) for n in names if n.endswith(".pickle"))


def files_by(folder, reason=None, pid=None):
    out = []
    for p in list_snapshots(folder):
        info = parse_name(p)
        if reason is not None:
            if info is not None and info["reason"] != reason:
                continue
            if info is None and f"-{reason}-" not in os.path.basename(p):
                continue
        if pid is not None and (info is None or info["pid"] != pid):
            continue
        out.append(p)
    return out


def count_per_pid(folder):
    counts = {}
    for p in list_snapshots(folder):
        info = parse_name(p)
        key = str(info["pid"]) if info else "unparsed"
        counts[key] = counts.get(key, 0) + 1
    return counts


def wait_for_new(folder, reason, before, timeout=30.0, poll=0.002):
    """Waits for a snapshot file with `reason` in its name that is not in `before`; returns
    (path or None, seconds waited)."""
    t0 = time.perf_counter()
    while True:
        for p in files_by(folder, reason=reason):
            if p not in before:
                return p, time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            return None, time.perf_counter() - t0
        time.sleep(poll)


def load_snapshot(path, retries=20):
    """Loads a pickle; retries briefly in case the writer has not finished (no atomic rename)."""
    last = None
    for _ in range(retries):
        try:
            with open(path, "rb") as f:
                return pickle.load(f)
        except Exception as e:  # noqa: BLE001
            last = e
            time.sleep(0.1)
    raise RuntimeError(f"cannot load {path}: {last!r}")


def c_handler_installed(signum=signal.SIGUSR1):
    """True when the kernel has a handler (memsnap's) for `signum`: raising it is then safe.
    Reads the caught-signals mask (SigCgt) of /proc/self/status: asking sigaction() would not do,
    since memsnap answers it with the program's own action (docs/SIGNALS.md)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(signum) - 1) & 1)
    except (OSError, ValueError):
        pass
    return None


def memsnap_dump(tag):
    """memsnap_dump_path from the preloaded library: the snapshot's path, or None."""
    lib = ctypes.CDLL(None)
    fn = getattr(lib, "memsnap_dump_path", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(4096)
    n = fn(tag.encode(), buf, 4096)
    return buf.raw[:n].decode() if 0 <= n < 4096 else None


def request_dump(folder, timeout=30.0, reason="signal"):
    """Sends SIGUSR1 to this process and waits for the new signal file.
    Returns a dict: file, wait_s, error."""
    before = set(files_by(folder, reason=reason))
    installed = c_handler_installed(signal.SIGUSR1)
    if installed is False:
        return {"file": None, "wait_s": None, "error": "no SIGUSR1 handler installed (memsnap not active?)"}
    t0 = time.perf_counter()
    os.kill(os.getpid(), signal.SIGUSR1)
    path, waited = wait_for_new(folder, reason, before, timeout=timeout)
    return {
        "file": path,
        "wait_s": time.perf_counter() - t0,
        "error": None if path else f"no *{reason}* file within {timeout}s",
        "handler_check": installed,
    }


# ----------------------------------------------------------------------------------------------
# Snapshot content


def live_blocks(snap, device=None):
    """Active blocks with their tiled addresses (the viewer recomputes addresses by tiling)."""
    out = []
    for seg in snap.get("segments", []):
        if device is not None and seg.get("device") != device:
            continue
        addr = seg.get("address", 0)
        for b in seg.get("blocks", []):
            if b.get("state") in ACTIVE_STATES:
                out.append({
                    "device": seg.get("device"),
                    "addr": addr,
                    "size": b.get("size", 0),
                    "requested": b.get("requested_size", b.get("size", 0)),
                    "frames": b.get("frames", []),
                    "seg_address": seg.get("address"),
                    "seg_size": seg.get("total_size"),
                    "is_expandable": seg.get("is_expandable"),
                })
            addr += b.get("size", 0)
    return out


def all_events(snap):
    for dev, evs in enumerate(snap.get("device_traces", []) or []):
        for e in evs:
            yield dev, e


def action_counts(snap):
    c = {}
    for _, e in all_events(snap):
        a = e.get("action")
        c[a] = c.get(a, 0) + 1
    return c


def metadata_counts(snap):
    c = {}
    for _, e in all_events(snap):
        if e.get("action") in ("alloc", "segment_alloc", "segment_map"):
            k = str(e.get("user_metadata", ""))
            c[k] = c.get(k, 0) + 1
    return c


def live_from_trace(snap):
    """Replays alloc/free events: addr -> (alloc event) for allocations not freed at the end."""
    live = {}
    for dev, e in all_events(snap):
        a = e.get("action")
        if a == "alloc":
            live[(dev, e.get("addr"))] = e
        elif a in ("free_completed", "free"):
            live.pop((dev, e.get("addr")), None)
    return live


def frames_present(snap):
    n = 0
    for _, e in all_events(snap):
        if e.get("frames"):
            n += 1
    for seg in snap.get("segments", []):
        for b in seg.get("blocks", []):
            if b.get("frames"):
                n += 1
    return n


def frame_names(frames):
    return [str(f.get("name", "")) for f in frames or [] if isinstance(f, dict)]


def memsnap_meta(snap):
    m = snap.get("memsnap")
    return m if isinstance(m, dict) else {}


def summarize(snap):
    lb = live_blocks(snap)
    return {
        "segments": len(snap.get("segments", [])),
        "devices_in_traces": len(snap.get("device_traces", []) or []),
        "events": sum(len(x) for x in snap.get("device_traces", []) or []),
        "actions": action_counts(snap),
        "user_metadata": metadata_counts(snap),
        "live_blocks": len(lb),
        "live_bytes": sum(b["size"] for b in lb),
        "live_requested_bytes": sum(b["requested"] for b in lb),
        "events_with_frames": frames_present(snap),
        "memsnap": {k: v for k, v in memsnap_meta(snap).items() if not isinstance(v, (list, dict)) or len(str(v)) < 2000},
    }


def structure_problems(snap, limit=40):
    """A light reading of docs/FORMAT.md ("Producer's rules" and "Forward history rule"): shapes,
    tiling, required keys, and the replayed live set equal to the final segments. Returns a list
    of problem strings."""
    probs = []

    def bad(msg):
        if len(probs) < limit:
            probs.append(msg)

    if not isinstance(snap, dict):
        return [f"top level is {type(snap).__name__}, not dict"]
    segs = snap.get("segments")
    traces = snap.get("device_traces")
    if not isinstance(segs, list):
        bad("segments missing or not a list")
        segs = []
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        bad("device_traces missing or not a list of lists")
        traces = []
    max_dev = -1
    for i, seg in enumerate(segs):
        for k in ("device", "address", "total_size", "stream", "blocks"):
            if k not in seg:
                bad(f"segment {i} lacks {k}")
        if "allocated_size" not in seg:
            bad(f"segment {i} lacks allocated_size (_memory_viz trace needs it)")
        dev = seg.get("device", 0)
        if isinstance(dev, int):
            max_dev = max(max_dev, dev)
        total = 0
        for j, b in enumerate(seg.get("blocks", [])):
            if b.get("state") not in BLOCK_STATES:
                bad(f"segment {i} block {j} state {b.get('state')!r}")
            if ("frames" in b) != ("requested_size" in b):
                bad(f"segment {i} block {j}: frames and requested_size must come together")
            if b.get("requested_size", 0) > b.get("size", 0):
                bad(f"segment {i} block {j}: requested_size > size")
            total += b.get("size", 0)
        if total != seg.get("total_size"):
            bad(f"segment {i} at {seg.get('address')}: blocks sum {total} != total_size {seg.get('total_size')}")
    if max_dev >= len(traces):
        bad(f"device_traces has {len(traces)} lists, segments use device {max_dev}")
    by_dev = {}
    for seg in segs:
        by_dev.setdefault(seg.get("device"), []).append((seg.get("address", 0), seg.get("total_size", 0)))
    for dev, ranges in by_dev.items():
        ranges.sort()
        for (a0, s0), (a1, _) in zip(ranges, ranges[1:]):
            if a0 + s0 > a1:
                bad(f"device {dev}: segments overlap at {a0:#x}/{a1:#x}")
                break
    for dev, evs in enumerate(traces):
        for k, e in enumerate(evs):
            if not isinstance(e, dict):
                bad(f"device {dev} event {k} not a dict")
                continue
            a = e.get("action")
            if not isinstance(a, str):
                bad(f"device {dev} event {k}: action {a!r}")
                continue
            if not isinstance(e.get("size"), int):
                bad(f"device {dev} event {k} ({a}): size missing")
            if a not in ("oom", "snapshot") and not isinstance(e.get("addr"), int):
                bad(f"device {dev} event {k} ({a}): addr missing")
            if a == "oom" and not isinstance(e.get("device_free"), int):
                bad(f"device {dev} event {k}: oom without device_free")
            for key in ("addr", "size", "time_us"):
                v = e.get(key)
                if isinstance(v, int) and not (-(1 << 53) < v < (1 << 53)):
                    bad(f"device {dev} event {k}: {key}={v} outside +-2^53")
            fr = e.get("frames", [])
            if not isinstance(fr, list):
                bad(f"device {dev} event {k}: frames not a list")
            else:
                for f in fr[:3]:
                    if not (isinstance(f, dict) and isinstance(f.get("name"), str)
                            and isinstance(f.get("filename"), str) and isinstance(f.get("line"), int)):
                        bad(f"device {dev} event {k}: bad frame {f!r}")
                        break
            if "category" in e:
                bad(f"device {dev} event {k}: has 'category' (viewer typo crash risk)")
    # Forward replay of blocks: each address allocated at most once while live, and the live set
    # at the end equals the active blocks (for addresses the trace knows about).
    live_tr = {}
    double = 0
    for dev, evs in enumerate(traces):
        for e in evs:
            if not isinstance(e, dict):
                continue
            a, addr = e.get("action"), e.get("addr")
            if a == "alloc":
                if (dev, addr) in live_tr:
                    double += 1
                live_tr[(dev, addr)] = e.get("size")
            elif a in ("free_completed", "free"):
                live_tr.pop((dev, addr), None)
    if double:
        bad(f"{double} alloc events at an address that was still live")
    seen_in_trace = {(dev, e.get("addr")) for dev, evs in enumerate(traces) for e in evs
                     if isinstance(e, dict) and e.get("action") in ("alloc", "free_requested", "free_completed", "free")}
    active = {(b["device"], b["addr"]): b for b in live_blocks(snap)}
    missing = [k for k in live_tr if k not in active]
    extra = [k for k in active if k in seen_in_trace and k not in live_tr]
    if missing:
        bad(f"{len(missing)} allocations live in the trace but not in segments, e.g. {missing[:3]}")
    if extra:
        bad(f"{len(extra)} active blocks whose last trace event is a free, e.g. {extra[:3]}")
    return probs


def opcode_problems(path, max_bytes=40 * MIB):
    """docs/FORMAT.md, "Producer's rules", rules 3 and 4: PROTO <= 4, viewer-known opcodes,
    LONG1 <= 8 bytes, APPENDS/SETITEMS batches <= 1000."""
    if os.path.getsize(path) > max_bytes:
        return None
    with open(path, "rb") as f:
        data = f.read()
    probs = []
    unknown = {}
    for op, arg, pos in pickletools.genops(data):
        name = op.name
        if name == "PROTO" and arg > 4:
            probs.append(f"protocol {arg} > 4")
        if name not in JS_OPCODES:
            unknown[name] = unknown.get(name, 0) + 1
        if name == "LONG1" and isinstance(arg, int) and (arg >= 1 << 63 or arg < -(1 << 63)):
            probs.append(f"LONG1 wider than 8 bytes at {pos}")
    if unknown:
        probs.append(f"opcodes the viewer rejects: {unknown}")
    probs.extend(_batch_problems(data))
    return probs


def _batch_problems(data):
    """Exact item count per MARK...APPENDS/SETITEMS using a small stack machine over genops."""
    probs = []
    # Track the stack height instead of items: each opcode's stack effect from pickletools.
    height = 0
    marks = []
    for op, arg, pos in pickletools.genops(data):
        if op.name == "MARK":
            marks.append(height)
            continue
        if op.name in ("APPENDS", "SETITEMS"):
            if marks:
                start = marks.pop()
                items = height - start
                n = items if op.name == "APPENDS" else items // 2
                if n > 1000:
                    probs.append(f"{op.name} batch of {n} items at byte {pos}")
                    if len(probs) > 5:
                        break
                height = start
            continue
        if op.name in ("TUPLE", "LIST", "DICT", "POP_MARK", "FROZENSET", "ADDITEMS", "OBJ", "INST"):
            if marks:
                height = marks.pop()
            if op.name in ("TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"):
                height += 1
            continue
        before = len(op.stack_before)
        after = len(op.stack_after)
        height += after - before
    return probs


def frames_mention(frames, needle):
    return any(needle in str(f.get("name", "")) for f in frames or [] if isinstance(f, dict))


def main_self_test():
    """python3 snaputil.py FILE...: prints the summary and problems of each file."""
    for p in sys.argv[1:]:
        s = load_snapshot(p)
        print(p, json.dumps(summarize(s), default=str)[:2000])
        print("  structure:", structure_problems(s))
        print("  opcodes:", opcode_problems(p))


if __name__ == "__main__":
    main_self_test()
