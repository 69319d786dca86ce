#!/usr/bin/env python3
"""Independent checker for PyTorch CUDA memory-snapshot pickles (stdlib only).

Usage: python3 tests/python/check_snapshot.py FILE [FILE...] [--json]

Exit status 0 when every file is valid, 1 otherwise (errors are printed per file).
The rules come from the team's format specification (snapshot-format.md, kept outside this
repository; the § numbers below are its sections); docs/FORMAT.md is the repository's account
of the same rules:

* opcodes (§6.2): every opcode in the viewer's whitelist, 2 <= PROTO <= 4, LONG1 <= 8
  bytes, no MARK...APPENDS / MARK...SETITEMS batch over 1000 items, never MEMOIZE mixed
  with BINPUT/LONG_BINPUT;
* shape (§0 items 1, 2, 5, 6, 8, 11, 12; §3, §4, §5): required keys and types, ints
  within int64 (and below 2**53 in absolute value for addresses, sizes and times);
* tiling and `_memory_viz segsum` (§3): blocks in address order from the segment address,
  sizes summing to total_size, requested_size <= size, segments of a device disjoint;
* forward history (§7.3) ending in `segments` (rule for capped histories below);
* the viewer's "Allocator State History" backward walk (§7.1, §7.2) with its crash
  conditions checked at every event index.

Capped histories (ring buffer, §8.4): the log may start mid-way. The forward replay does
not start from an empty state but from the state S0 reconstructed by undoing every event,
last to first, starting from `segments` (what the viewer does). The history is accepted
iff S0 is itself a valid state (disjoint segments, every live block inside one segment,
disjoint blocks), every event is legal when replayed forward from S0, and the end state
equals `segments`. A full history gives S0 = empty; a suffix of a valid history gives the
state at the cut. The Rust checker (src/snapshot/check.rs) uses the same rule.
"""

import argparse
import json
import pickle
import pickletools
import sys

WHITELIST = {
    "PROTO", "STOP", "MARK", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "SETITEM",
    "SETITEMS", "DICT", "APPEND", "APPENDS", "LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "NONE", "NEWTRUE", "NEWFALSE", "BININT1", "BININT2", "BININT", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE", "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET",
    "LONG_BINGET", "FRAME",
}
PUSH_ONE = {
    "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "NONE", "NEWTRUE", "NEWFALSE", "BININT1",
    "BININT2", "BININT", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "BINGET",
    "LONG_BINGET",
}
NO_STACK = {"PROTO", "FRAME", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
BATCH = 1000
INT64 = (-(1 << 63), (1 << 63) - 1)
JS_SAFE = 1 << 53
LIVE_STATES = ("active_allocated", "active_pending_free")
BLOCK_STATES = LIVE_STATES + ("inactive",)
KNOWN_ACTIONS = {
    "alloc", "free_requested", "free_completed", "free", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "snapshot", "oom",
    "annotate",  # newest PyTorch: a note on an allocation, no state change (§5.2)
}


class Report:
    # Errors kept per section, so that one broken rule cannot hide the others.
    LIMIT = 50

    def __init__(self, path):
        self.path = path
        self.errors = []
        self.summary = {}
        self.section = "load"
        self.counts = {}

    def err(self, msg):
        n = self.counts.get(self.section, 0) + 1
        self.counts[self.section] = n
        if n <= self.LIMIT:
            self.errors.append(f"[{self.section}] {msg}")
        elif n == self.LIMIT + 1:
            self.errors.append(f"[{self.section}] ... further {self.section} errors left out")


# ---------------------------------------------------------------------------- opcodes


def check_opcodes(data, rep):
    ops = list(pickletools.genops(data))
    depth = 0
    marks = []
    seen_memoize = seen_binput = False
    for i, (opc, arg, pos) in enumerate(ops):
        name = opc.name
        if name not in WHITELIST:
            rep.err(f"opcode {name} at byte {pos} is not in the viewer's whitelist (§6.2)")
            continue
        if name == "PROTO" and not (2 <= arg <= 4):
            rep.err(f"PROTO {arg}: the viewer accepts only 2, 3 or 4")
        elif name == "LONG1":
            end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
            nbytes = end - pos - 2
            if nbytes > 8:
                rep.err(f"LONG1 of {nbytes} bytes at byte {pos} (value {arg}): a JS BigInt")
        elif name == "MEMOIZE":
            seen_memoize = True
        elif name in ("BINPUT", "LONG_BINPUT"):
            seen_binput = True
        if name == "MARK":
            marks.append(depth)
        elif name in PUSH_ONE:
            depth += 1
        elif name in NO_STACK:
            pass
        elif name in ("APPENDS", "SETITEMS", "DICT", "LIST", "TUPLE"):
            if not marks:
                rep.err(f"{name} at byte {pos} without MARK")
                continue
            n = depth - marks.pop()
            items = n // 2 if name in ("SETITEMS", "DICT") else n
            if items > BATCH and name in ("APPENDS", "SETITEMS"):
                rep.err(f"{name} batch of {items} items at byte {pos} (max {BATCH})")
            depth -= n
            if name in ("DICT", "LIST", "TUPLE"):
                depth += 1
        elif name == "APPEND":
            depth -= 1
        elif name == "SETITEM":
            depth -= 2
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            depth -= int(name[-1]) - 1
        elif name == "STOP":
            break
    if seen_memoize and seen_binput:
        rep.err("MEMOIZE mixed with BINPUT/LONG_BINPUT: the viewer's memo numbering breaks")
    return len(ops)


# ---------------------------------------------------------------------------- shape


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def walk_types(obj, where, rep):
    """§0.5: only dict (str keys), list, tuple, str, int (int64), float, bool."""
    stack = [(obj, where)]
    seen = set()
    while stack:
        o, w = stack.pop()
        if isinstance(o, (dict, list, tuple)):
            if id(o) in seen:
                continue
            seen.add(id(o))
        if isinstance(o, dict):
            for k, v in o.items():
                if not isinstance(k, str):
                    rep.err(f"{w}: non-str dict key {k!r}")
                stack.append((v, f"{w}.{k}"))
        elif isinstance(o, (list, tuple)):
            for j, v in enumerate(o):
                stack.append((v, f"{w}[{j}]"))
        elif isinstance(o, bool) or isinstance(o, (str, float)):
            pass
        elif isinstance(o, int):
            if not (INT64[0] <= o <= INT64[1]):
                rep.err(f"{w}: int {o} outside int64")
        else:
            rep.err(f"{w}: value of type {type(o).__name__} (only dict/list/tuple/str/int/float/bool)")


def need_int(d, key, where, rep, js_safe=False, required=True):
    if key not in d:
        if required:
            rep.err(f"{where}: missing '{key}'")
        return None
    v = d[key]
    if not is_int(v):
        rep.err(f"{where}: '{key}' is {type(v).__name__}, not int")
        return None
    if js_safe and abs(v) >= JS_SAFE:
        rep.err(f"{where}: '{key}' = {v} is not below 2**53 (precision lost in JS)")
    return v


def check_frames(frames, where, rep, checked):
    if not isinstance(frames, list):
        rep.err(f"{where}: frames is {type(frames).__name__}, not list")
        return
    if id(frames) in checked:
        return
    checked.add(id(frames))
    for j, f in enumerate(frames):
        if not isinstance(f, dict):
            rep.err(f"{where}.frames[{j}]: not a dict")
            continue
        for k in ("name", "filename"):
            if not isinstance(f.get(k), str):
                rep.err(f"{where}.frames[{j}]: '{k}' must be a str, got {f.get(k)!r}")
        if not is_int(f.get("line")):
            rep.err(f"{where}.frames[{j}]: 'line' must be an int, got {f.get('line')!r}")


def check_shape(snap, rep):
    """Returns (segments, traces) when usable for the replay checks, else None."""
    if not isinstance(snap, dict):
        rep.err(f"top level is {type(snap).__name__}, not dict (§0.1)")
        return None
    walk_types(snap, "snapshot", rep)
    segs = snap.get("segments")
    traces = snap.get("device_traces")
    if not isinstance(segs, list):
        rep.err("missing or non-list 'segments'")
        return None
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        rep.err("missing 'device_traces' or not a list of lists")
        return None
    if "allocator_settings" in snap and not isinstance(snap["allocator_settings"], dict):
        rep.err("'allocator_settings' is not a dict")
    if "external_annotations" in snap and not isinstance(snap["external_annotations"], list):
        rep.err("'external_annotations' is not a list")
    for k in ("version", "idx", "categories"):
        if k in snap:
            rep.err(f"top-level '{k}' must not be emitted (§0.12)")
    checked = set()
    ok = True
    for i, s in enumerate(segs):
        w = f"segments[{i}]"
        if not isinstance(s, dict):
            rep.err(f"{w}: not a dict")
            ok = False
            continue
        dev = need_int(s, "device", w, rep)
        addr = need_int(s, "address", w, rep, js_safe=True)
        total = need_int(s, "total_size", w, rep, js_safe=True)
        need_int(s, "stream", w, rep)
        if None in (dev, addr, total):
            ok = False
            continue
        if dev < 0 or dev >= len(traces):
            rep.err(f"{w}: device {dev} has no list in device_traces (len {len(traces)}) (§0.2)")
            ok = False
        if "frames" in s:
            check_frames(s["frames"], w, rep, checked)
        blocks = s.get("blocks")
        if not isinstance(blocks, list):
            rep.err(f"{w}: missing or non-list 'blocks'")
            ok = False
            continue
        for j, b in enumerate(blocks):
            wb = f"{w}.blocks[{j}]"
            if not isinstance(b, dict):
                rep.err(f"{wb}: not a dict")
                ok = False
                continue
            size = need_int(b, "size", wb, rep, js_safe=True)
            need_int(b, "address", wb, rep, js_safe=True, required=False)
            if b.get("state") not in BLOCK_STATES:
                rep.err(f"{wb}: state {b.get('state')!r} is not one of {BLOCK_STATES}")
            has_f, has_r = "frames" in b, "requested_size" in b
            if has_f != has_r:
                rep.err(f"{wb}: has {'frames' if has_f else 'requested_size'} without "
                        f"{'requested_size' if has_f else 'frames'} (§0.8)")
            if has_f:
                check_frames(b["frames"], wb, rep, checked)
            req = need_int(b, "requested_size", wb, rep, required=False)
            if size is None:
                ok = False
            elif req is not None and req > size:
                rep.err(f"{wb}: requested_size {req} > size {size}")
        if isinstance(s.get("segment_pool_id"), list):
            rep.err(f"{w}: segment_pool_id must be a tuple")
    any_category = any_unknown = False
    for d, trace in enumerate(traces):
        for i, e in enumerate(trace):
            w = f"device_traces[{d}][{i}]"
            if not isinstance(e, dict):
                rep.err(f"{w}: not a dict")
                ok = False
                continue
            act = e.get("action")
            if not isinstance(act, str):
                rep.err(f"{w}: 'action' must be a str, got {act!r} (§0.5)")
                ok = False
                continue
            if act not in KNOWN_ACTIONS:
                rep.err(f"{w}: unknown action {act!r}")
            if need_int(e, "size", w, rep, js_safe=True) is None:
                ok = False
            if act not in ("oom", "snapshot"):
                if need_int(e, "addr", w, rep, js_safe=True) is None:
                    ok = False
            else:
                need_int(e, "addr", w, rep, js_safe=True, required=False)
            if act == "oom":
                need_int(e, "device_free", w, rep)
            need_int(e, "stream", w, rep)
            need_int(e, "time_us", w, rep, js_safe=True)
            if "frames" in e:
                check_frames(e["frames"], w, rep, checked)
            for k in ("version", "idx"):
                if k in e:
                    rep.err(f"{w}: '{k}' must not be emitted (§0.12)")
            if "category" in e:
                any_category = True
                any_unknown |= e["category"] == "unknown"
            um = e.get("user_metadata")
            if um is not None and not isinstance(um, (str, dict)):
                rep.err(f"{w}: user_metadata must be str or dict")
    if any_category and not any_unknown:
        rep.err("events carry 'category' but none is 'unknown': the viewer throws (§0.12, §9.7)")
    return (segs, traces) if ok else None


def check_tiling(segs, traces, rep):
    """§3: blocks tile their segment; segsum; per-device segments disjoint."""
    by_dev = {}
    for i, s in enumerate(segs):
        w = f"segments[{i}] (device {s['device']}, address {s['address']:#x})"
        total = s["total_size"]
        running = 0
        for j, b in enumerate(s["blocks"]):
            if "address" in b and b["address"] != s["address"] + running:
                rep.err(f"{w}.blocks[{j}]: address {b['address']:#x} != tiled address "
                        f"{s['address'] + running:#x}")
            if b["size"] < 0:
                rep.err(f"{w}.blocks[{j}]: negative size")
            running += b["size"]
        if running != total:
            rep.err(f"{w}: block sizes sum to {running}, total_size is {total} (segsum)")
        # _memory_viz segsum: Σ requested(active_allocated) + Σ (size-requested)(active_allocated)
        # + Σ size(other states) == total_size.
        alloc = sum(b.get("requested_size", b["size"]) for b in s["blocks"] if b["state"] == "active_allocated")
        waste = sum(b["size"] - b.get("requested_size", b["size"]) for b in s["blocks"] if b["state"] == "active_allocated")
        other = sum(b["size"] for b in s["blocks"] if b["state"] != "active_allocated")
        if alloc + waste + other != total:
            rep.err(f"{w}: segsum assertion fails")
        exp_alloc = sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
        if is_int(s.get("allocated_size")) and s["allocated_size"] != exp_alloc:
            rep.err(f"{w}: allocated_size {s['allocated_size']} != Σ active_allocated sizes {exp_alloc}")
        if total <= 0:
            rep.err(f"{w}: total_size {total} is not positive")
        by_dev.setdefault(s["device"], []).append((s["address"], total, i))
    for dev, lst in by_dev.items():
        lst.sort()
        for (a0, s0, i0), (a1, s1, i1) in zip(lst, lst[1:]):
            if a0 + s0 > a1:
                rep.err(f"device {dev}: segments[{i0}] and segments[{i1}] overlap")


# ---------------------------------------------------------------------------- replay


class State:
    """Segments (addr -> [size, mapped, stream]) and live blocks (addr -> [size, pending])."""

    def __init__(self):
        self.segs = {}
        self.blocks = {}

    def seg_containing(self, a, n):
        for sa, (ss, mapped, stream) in self.segs.items():
            if sa <= a and a + max(n, 1) <= sa + max(ss, 1):
                return sa
        return None

    def segs_overlapping(self, a, n):
        return [sa for sa, (ss, _, _) in self.segs.items() if sa < a + max(n, 1) and a < sa + max(ss, 1)]

    def blocks_overlapping(self, a, n):
        return [ba for ba, (bs, _) in self.blocks.items() if ba < a + max(n, 1) and a < ba + max(bs, 1)]

    def map_range(self, a, n, stream):
        """Adds a mapped range and merges it with adjacent mapped ranges on the same stream."""
        start, end = a, a + n
        for sa, (ss, mapped, st) in list(self.segs.items()):
            if mapped and st == stream and (sa + ss == start or sa == end):
                del self.segs[sa]
                start, end = min(start, sa), max(end, sa + ss)
        self.segs[start] = [end - start, True, stream]

    def carve(self, a, n):
        sa = self.seg_containing(a, n)
        if sa is None:
            return False
        ss, mapped, st = self.segs.pop(sa)
        if a > sa:
            self.segs[sa] = [a - sa, mapped, st]
        if a + n < sa + ss:
            self.segs[a + n] = [sa + ss - a - n, mapped, st]
        return True


def final_state(segs, dev):
    st = State()
    for s in segs:
        if s["device"] != dev:
            continue
        st.segs[s["address"]] = [s["total_size"], bool(s.get("is_expandable")), s.get("stream", 0)]
        running = s["address"]
        for b in s["blocks"]:
            if b["state"] in LIVE_STATES:
                st.blocks[running] = [b.get("requested_size", b["size"]), b["state"] == "active_pending_free"]
            running += b["size"]
    return st


def undo(st, e):
    """Best-effort inverse of one event (used to reconstruct S0)."""
    act, a, n = e["action"], e.get("addr"), e.get("size")
    if act == "segment_alloc":
        st.segs.pop(a, None)
    elif act == "segment_free":
        st.segs[a] = [n, False, e.get("stream", 0)]
    elif act == "segment_map":
        st.carve(a, n)
    elif act == "segment_unmap":
        st.map_range(a, n, e.get("stream", 0))
    elif act == "alloc":
        st.blocks.pop(a, None)
    elif act == "free_requested":
        if a in st.blocks:
            st.blocks[a][1] = False
    elif act == "free_completed":
        st.blocks[a] = [n, True]
    elif act == "free":
        st.blocks[a] = [n, False]


def check_state_valid(st, where, rep):
    lst = sorted((sa, ss) for sa, (ss, _, _) in st.segs.items())
    for (a0, s0), (a1, s1) in zip(lst, lst[1:]):
        if a0 + s0 > a1:
            rep.err(f"{where}: segments at {a0:#x} and {a1:#x} overlap")
    blst = sorted((ba, bs) for ba, (bs, _) in st.blocks.items())
    for (a0, s0), (a1, s1) in zip(blst, blst[1:]):
        if a0 + s0 > a1:
            rep.err(f"{where}: live blocks at {a0:#x} and {a1:#x} overlap")
    for ba, bs in blst:
        if st.seg_containing(ba, bs) is None:
            rep.err(f"{where}: live block [{ba:#x}, +{bs}) lies in no segment")


def forward(st, e, w, rep):
    act, a, n, stream = e["action"], e.get("addr"), e.get("size"), e.get("stream", 0)
    if act == "segment_alloc":
        if st.segs_overlapping(a, n):
            rep.err(f"{w}: segment_alloc [{a:#x}, +{n}) overlaps a live segment")
        st.segs[a] = [n, False, stream]
    elif act == "segment_free":
        seg = st.segs.get(a)
        if seg is None or seg[0] != n:
            rep.err(f"{w}: segment_free [{a:#x}, +{n}) of no such live segment")
        elif seg[1]:
            rep.err(f"{w}: segment_free of a mapped (expandable) range")
        if st.blocks_overlapping(a, n):
            rep.err(f"{w}: segment_free [{a:#x}, +{n}) while it holds live blocks")
        st.segs.pop(a, None)
    elif act == "segment_map":
        if st.segs_overlapping(a, n):
            rep.err(f"{w}: segment_map [{a:#x}, +{n}) overlaps a live segment")
        st.map_range(a, n, stream)
    elif act == "segment_unmap":
        sa = st.seg_containing(a, n)
        if sa is None or not st.segs[sa][1]:
            rep.err(f"{w}: segment_unmap [{a:#x}, +{n}) is not inside a mapped range")
        if st.blocks_overlapping(a, n):
            rep.err(f"{w}: segment_unmap [{a:#x}, +{n}) while it holds live blocks")
        if sa is not None:
            st.carve(a, n)
    elif act == "alloc":
        if st.seg_containing(a, n) is None:
            rep.err(f"{w}: alloc [{a:#x}, +{n}) lies in no live segment")
        if st.blocks_overlapping(a, n):
            rep.err(f"{w}: alloc [{a:#x}, +{n}) overlaps a live block")
        st.blocks[a] = [n, False]
    elif act in ("oom", "snapshot", "annotate"):
        pass
    elif act in ("free_requested", "free_completed", "free"):
        b = st.blocks.get(a)
        if b is None:
            rep.err(f"{w}: {act} at {a:#x}: no live block starts there")
            return
        if b[0] != n:
            rep.err(f"{w}: {act} size {n} != allocated size {b[0]}")
        if act == "free_requested":
            if b[1]:
                rep.err(f"{w}: free_requested twice for {a:#x}")
            b[1] = True
        elif act == "free_completed":
            if not b[1]:
                rep.err(f"{w}: free_completed at {a:#x} without free_requested")
            del st.blocks[a]
        else:
            del st.blocks[a]


def compare_end(st, final, where, rep):
    for sa in sorted(set(st.segs) | set(final.segs)):
        x, y = st.segs.get(sa), final.segs.get(sa)
        if x is None:
            rep.err(f"{where}: segment at {sa:#x} in `segments` but not live after the history")
        elif y is None:
            rep.err(f"{where}: segment [{sa:#x}, +{x[0]}) live after the history but not in `segments`")
        elif x[0] != y[0] or x[1] != y[1]:
            rep.err(f"{where}: segment at {sa:#x}: history ends with size {x[0]} "
                    f"{'mapped' if x[1] else 'whole'}, `segments` says {y[0]} "
                    f"{'expandable' if y[1] else 'whole'}")
    for ba in sorted(set(st.blocks) | set(final.blocks)):
        x, y = st.blocks.get(ba), final.blocks.get(ba)
        if x is None:
            rep.err(f"{where}: live block at {ba:#x} in `segments` but not live after the history")
        elif y is None:
            rep.err(f"{where}: block [{ba:#x}, +{x[0]}) live after the history but not in `segments`")
        elif x != y:
            rep.err(f"{where}: block at {ba:#x}: history ends with (size {x[0]}, pending {x[1]}), "
                    f"`segments` has (requested_size {y[0]}, pending {y[1]})")


def check_forward(segs, trace, dev, rep):
    final = final_state(segs, dev)
    st = final_state(segs, dev)
    for e in reversed(trace):
        undo(st, e)
    check_state_valid(st, f"device {dev}: reconstructed state before event 0", rep)
    for i, e in enumerate(trace):
        forward(st, e, f"device {dev} event {i} ({e['action']})", rep)
    compare_end(st, final, f"device {dev} end state", rep)


def merge_frees(trace):
    """§7.1: free_requested immediately followed by free_completed (same addr) -> free."""
    out = []
    for e in trace:
        if (e["action"] == "free_completed" and out and out[-1]["action"] == "free_requested"
                and out[-1].get("addr") == e.get("addr")):
            out[-1] = dict(out[-1], action="free")
        else:
            out.append(e)
    return out


def check_viewer_history(segs, trace, dev, rep):
    """§7.2: the viewer's backward walk; crash conditions at every event index."""
    events = merge_frees(trace)
    seglist = []  # [addr, size, stream]
    blocks = {}  # addr -> [size, pending]
    for s in segs:
        if s["device"] != dev:
            continue
        seglist.append([s["address"], s["total_size"], s.get("stream", 0)])
        running = s["address"]
        for b in s["blocks"]:
            if b["state"] in LIVE_STATES:
                blocks[running] = [b.get("requested_size", b["size"]), b["state"] == "active_pending_free"]
            running += b["size"]

    def containing(a, n):
        for k, (sa, ss, _) in enumerate(seglist):
            if sa <= a and a + n <= sa + ss:
                return k
        return None

    def check_blocks(where, only=None):
        for ba, (bs, _) in blocks.items():
            if only is not None and not (only[0] < ba + max(bs, 1) and ba < only[1]):
                continue
            if containing(ba, bs) is None:
                rep.err(f"device {dev}, state after event {where}: live block [{ba:#x}, +{bs}) "
                        "lies in no segment (viewer: TypeError reading 'occupied')")

    last = len(events) - 1
    check_blocks(last)
    # Undoing event k yields the state after event k-1; the earliest reachable state is
    # the one after event 0, so event 0 itself is never undone.
    for k in range(last, 0, -1):
        e = events[k]
        act, a, n = e["action"], e.get("addr"), e.get("size")
        where = f"{k - 1} (undoing event {k}, {act})"
        if act not in ("oom", "snapshot") and a is None:
            rep.err(f"device {dev}, event {k}: {act} without addr")
            continue
        if act == "free":
            blocks[a] = [n, False]
            check_blocks(where, (a, a + max(n, 1)))
        elif act == "free_completed":
            blocks[a] = [n, True]
            check_blocks(where, (a, a + max(n, 1)))
        elif act == "free_requested":
            if a not in blocks:
                rep.err(f"device {dev}, state after event {where}: no block at {a:#x} "
                        "(viewer: TypeError)")
            else:
                blocks[a][1] = False
        elif act == "alloc":
            blocks.pop(a, None)
        elif act == "segment_free":
            seglist.append([a, n, e.get("stream", 0)])
            seglist.sort()
        elif act == "segment_unmap":
            start, end, st = a, a + n, e.get("stream", 0)
            keep = []
            for sa, ss, sst in seglist:
                if sst == st and (sa + ss == start or sa == end):
                    start, end = min(start, sa), max(end, sa + ss)
                else:
                    keep.append([sa, ss, sst])
            keep.append([start, end - start, st])
            seglist[:] = sorted(keep)
        elif act == "segment_alloc":
            idx = next((j for j, s in enumerate(seglist) if s[0] == a), None)
            if idx is None:
                rep.err(f"device {dev}, state after event {where}: no segment starts at "
                        f"{a:#x} (viewer silently removes the last segment)")
            else:
                removed = seglist.pop(idx)
                check_blocks(where, (removed[0], removed[0] + removed[1]))
        elif act == "segment_map":
            idx = containing(a, n)
            if idx is None:
                rep.err(f"device {dev}, state after event {where}: no segment contains "
                        f"[{a:#x}, +{n}) (viewer: TypeError)")
            else:
                sa, ss, st = seglist.pop(idx)
                if a > sa:
                    seglist.append([sa, a - sa, st])
                if a + n < sa + ss:
                    seglist.append([a + n, sa + ss - a - n, st])
                seglist.sort()
                check_blocks(where, (a, a + n))


# ---------------------------------------------------------------------------- driver


def check_file(path, opcodes_only=False):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        rep = Report(path)
        rep.err(f"cannot read: {exc}")
        return rep
    return check_bytes(data, path, opcodes_only)


def check_bytes(data, path, opcodes_only=False):
    rep = Report(path)
    try:
        snap = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a finding
        rep.err(f"pickle.load failed: {exc!r}")
        return rep
    rep.section = "opcodes"
    rep.summary["opcodes"] = check_opcodes(data, rep)
    rep.summary["bytes"] = len(data)
    if opcodes_only:
        return rep
    rep.section = "shape"
    shape = check_shape(snap, rep)
    if shape is None:
        return rep
    segs, traces = shape
    rep.section = "tiling"
    check_tiling(segs, traces, rep)
    for dev, trace in enumerate(traces):
        rep.section = "history"
        check_forward(segs, trace, dev, rep)
        rep.section = "viewer"
        check_viewer_history(segs, trace, dev, rep)
    rep.summary["events_per_device"] = [len(t) for t in traces]
    live = [0] * len(traces)
    for s in segs:
        if 0 <= s["device"] < len(traces):
            live[s["device"]] += sum(b["size"] for b in s["blocks"] if b["state"] in LIVE_STATES)
    rep.summary["live_bytes_per_device"] = live
    rep.summary["segments"] = len(segs)
    frame_lists = set()
    for t in traces:
        for e in t:
            if "frames" in e:
                frame_lists.add(id(e["frames"]))
    for s in segs:
        if "frames" in s:
            frame_lists.add(id(s["frames"]))
        for b in s["blocks"]:
            if "frames" in b:
                frame_lists.add(id(b["frames"]))
    rep.summary["unique_frame_lists"] = len(frame_lists)
    return rep


def self_test():
    """Checks the checker: valid histories pass, each known breakage is caught by the
    expected section (the crash table of §7.2 included). Returns the number of failures."""
    import random

    rng = random.Random(1)
    frames = [{"name": "f", "filename": "a.py", "line": 1}]

    def ev(a, addr, size):
        return {"action": a, "addr": addr, "size": size, "stream": 0,
                "time_us": 1795314852136082, "frames": frames}

    trace, live, nxt = [], [], 0x7F0000000000
    for _ in range(400):
        if len(live) < 20 and (not live or rng.random() < 0.5):
            n = 512 * rng.randint(1, 4096)
            trace += [ev("segment_alloc", nxt, n), ev("alloc", nxt, n)]
            live.append((nxt, n))
            nxt += 4 << 20
        else:
            a, n = live.pop(rng.randrange(len(live)))
            trace += [ev("free_requested", a, n), ev("free_completed", a, n), ev("segment_free", a, n)]
    live.sort()
    segs = [{"device": 0, "address": a, "total_size": n, "allocated_size": n, "active_size": n,
             "requested_size": n, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
             "is_expandable": False, "frames": frames,
             "blocks": [{"address": a, "size": n, "requested_size": n, "state": "active_allocated",
                         "frames": frames}]} for a, n in live]

    def snap(t):
        return pickle.dumps({"segments": segs, "device_traces": [t], "allocator_settings": {},
                             "external_annotations": []}, protocol=4)

    def swap_first(t, first, second):
        """Moves the first `second` action before the `first` action preceding it."""
        t = list(t)
        j = next(i for i, e in enumerate(t) if e["action"] == second and i > 0)
        i = max(k for k in range(j) if t[k]["action"] == first and t[k]["addr"] == t[j]["addr"])
        t.insert(i, t.pop(j))
        return t

    without = lambda act: [e for e in trace if e["action"] != act]  # noqa: E731
    raw_unbatched = b"\x80\x02]q\x00(" + b"K\x00" * 1001 + b"e."
    raw_mixed_memo = b"\x80\x04]\x94]q\x01\x86."
    # (name, bytes, sections that must report errors; [] = valid)
    cases = [
        ("full history", snap(trace), []),
        ("ring-buffer suffix (137 dropped)", snap(trace[137:]), []),
        ("suffix starting with an orphan free_completed",
         snap(trace[next(i for i, e in enumerate(trace) if e["action"] == "free_completed"):]), []),
        ("free_completed dropped", snap(without("free_completed")), ["history", "viewer"]),
        ("free_requested dropped (red blocks, no crash)", snap(without("free_requested")), ["history"]),
        ("no segment events", snap([e for e in trace if not e["action"].startswith("segment")]),
         ["history", "viewer"]),
        ("only segment events", snap([e for e in trace if e["action"].startswith("segment")]),
         ["history", "viewer"]),
        ("alloc before its segment_alloc", snap(swap_first(trace, "segment_alloc", "alloc")),
         ["history", "viewer"]),
        ("segment_free before the block's free",
         snap(swap_first(trace, "free_requested", "segment_free")), ["history", "viewer"]),
        ("protocol 5", pickle.dumps({"segments": [], "device_traces": []}, protocol=5), ["opcodes"]),
        ("9-byte LONG1", pickle.dumps({"segments": [], "device_traces": [], "x": 1 << 64}, protocol=2),
         ["opcodes", "shape"]),
        ("unbatched APPENDS of 1001", raw_unbatched, ["opcodes", "shape"]),
        ("MEMOIZE mixed with BINPUT", raw_mixed_memo, ["opcodes", "shape"]),
    ]
    failures = 0
    for name, data, expect in cases:
        rep = check_bytes(data, name)
        got = sorted(rep.counts)
        if got != sorted(expect):
            failures += 1
            print(f"self-test FAILED: {name}: expected errors in {sorted(expect)}, got {got}")
            for e in rep.errors[:5]:
                print(f"  {e}")
        else:
            print(f"self-test ok: {name}")
    return failures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--self-test", action="store_true",
                    help="check the checker on built-in valid and broken snapshots")
    ap.add_argument("--json", action="store_true", help="print a machine-readable summary")
    ap.add_argument("--opcodes-only", action="store_true",
                    help="only load the file and check its opcodes (for encoder tests whose "
                         "values are not a valid history)")
    args = ap.parse_args(argv)
    if args.self_test:
        return 1 if self_test() else 0
    if not args.files:
        ap.error("no FILE given")
    reports = [check_file(p, args.opcodes_only) for p in args.files]
    if args.json:
        out = [dict(file=r.path, ok=not r.errors, error_counts=r.counts, errors=r.errors, **r.summary)
               for r in reports]
        print(json.dumps(out, indent=1))
    else:
        for r in reports:
            if r.errors:
                counts = ", ".join(f"{k}: {v}" for k, v in r.counts.items())
                print(f"{r.path}: INVALID ({counts})")
                for e in r.errors:
                    print(f"  {e}")
            else:
                ev = r.summary.get("events_per_device")
                if ev is None:
                    print(f"{r.path}: ok (opcodes and load only)")
                else:
                    print(f"{r.path}: ok ({sum(ev)} events on {len(ev)} device(s), "
                          f"{r.summary.get('segments')} segments)")
    return 0 if all(not r.errors for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
