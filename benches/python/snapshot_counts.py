"""What a benchmark run actually recorded, read from the snapshot it wrote: the shared
check that keeps hook-cost benchmarks honest (benches/hooks.sh,
benches/gpu/hook_cost_torch.py).

A measured run with libmemsnap.so preloaded writes its exit snapshot (MEMSNAP_AT_EXIT=1,
the default) into a folder of its own; the newest *.pickle there carries memsnap's metadata
(top-level key "memsnap"): events_recorded, dropped_events, events_without_stack (stacks
the hooks could not take: only possible once the writer is gone, src/channel/queue.rs).
Independently of those counters, when native frames were asked for (MEMSNAP_STACKS native
or all), every `alloc` entry of the history must carry frames: an alloc without frames is
counted as stackless too (a C caller has no Python frames, so `python` is not checked this
way). A cost figure measured while anything was lost is not a cost figure: verdict() says
VOID instead.

As a command (for shell scripts):
    python3 snapshot_counts.py FOLDER
        -> "<recorded> <dropped> <stackless>", or "missing" when no snapshot is there
    python3 snapshot_counts.py tally < RUNS
        RUNS: one line per run, "<config> <ns> <calls made or -> <the FOLDER output>"
        (baseline runs: "<config> <ns> - none"). Prints one line per config, in order of
        first appearance, tab-separated: config, best ns (over all its runs), events
        recorded per run ("—" without snapshots), dropped, stackless, and "OK" or the
        VOID text (then best ns is "—": no figure from a run that lost anything).
"""
import glob
import os
import pickle
import sys


def read_counts(folder):
    """{"recorded", "dropped", "stackless", "file", "torch_allocator"} from the newest
    *.pickle in folder, or None when there is none (or it carries no memsnap metadata)."""
    files = glob.glob(os.path.join(folder, "*.pickle"))
    if not files:
        return None
    newest = max(files, key=os.path.getmtime)
    with open(newest, "rb") as f:
        snap = pickle.load(f)
    meta = snap.get("memsnap") if isinstance(snap, dict) else None
    if not isinstance(meta, dict):
        return None
    stackless = int(meta.get("events_without_stack", 0))
    if meta.get("stacks") in ("native", "all"):
        stackless += sum(
            1
            for trace in snap.get("device_traces", [])
            for e in trace
            if e.get("action") == "alloc" and not e.get("frames")
        )
    return {
        "recorded": int(meta.get("events_recorded", 0)),
        "dropped": int(meta.get("dropped_events", 0)),
        "stackless": stackless,
        "file": newest,
        # How PyTorch's allocator was seen ("blocks: ...", "tensors: ...", "segments only: ...").
        "torch_allocator": str(meta.get("torch_allocator", "")),
    }


class Tally:
    """Counts over all runs of one configuration."""

    def __init__(self):
        self.runs = 0
        self.missing_snapshots = 0
        self.dropped = 0
        self.stackless = 0
        self.recorded = []  # per run
        self.short = 0  # events the program made that the snapshot does not account for

    def add(self, counts, expected_min=None):
        """counts: read_counts()'s result (None: no snapshot); expected_min: the number of
        CUDA calls the program made (the snapshot must account for at least as many)."""
        self.runs += 1
        if counts is None:
            self.missing_snapshots += 1
            return
        self.dropped += counts["dropped"]
        self.stackless += counts["stackless"]
        self.recorded.append(counts["recorded"])
        if expected_min is not None:
            self.short += max(0, expected_min - counts["recorded"] - counts["dropped"])

    def lost(self):
        return bool(self.missing_snapshots or self.dropped or self.stackless or self.short)

    def verdict(self):
        """None when every run recorded everything; else the VOID text to print in place of
        the cost figure."""
        if not self.lost():
            return None
        parts = [f"{self.dropped} dropped", f"{self.stackless} stackless"]
        if self.short:
            parts.append(f"{self.short} unaccounted")
        if self.missing_snapshots:
            parts.append(f"no snapshot in {self.missing_snapshots} of {self.runs} runs")
        return f"VOID ({', '.join(parts)})"

    def recorded_text(self):
        if not self.recorded:
            return "—"
        lo, hi = min(self.recorded), max(self.recorded)
        return f"{lo}" if lo == hi else f"{lo}–{hi}"


def tally_lines(lines):
    order, best, tallies = [], {}, {}
    for line in lines:
        f = line.split()
        if not f:
            continue
        config, ns, calls, rest = f[0], float(f[1]), f[2], f[3:]
        if config not in best:
            order.append(config)
            best[config] = ns
        best[config] = min(best[config], ns)
        if rest == ["none"]:
            continue  # not preloaded: nothing to check
        t = tallies.setdefault(config, Tally())
        counts = None  # "missing", or anything unreadable: counted as a missing snapshot
        if len(rest) == 3 and all(x.isdigit() for x in rest):
            counts = {"recorded": int(rest[0]), "dropped": int(rest[1]), "stackless": int(rest[2])}
        t.add(counts, None if calls == "-" else int(calls))
    out = []
    for config in order:
        t = tallies.get(config)
        if t is None:
            out.append([config, f"{best[config]:.1f}", "—", "—", "—", "OK"])
            continue
        v = t.verdict()
        out.append([config, "—" if v else f"{best[config]:.1f}", t.recorded_text(),
                    str(t.dropped), str(t.stackless), v or "OK"])
    return out


def main(argv):
    if len(argv) == 2 and argv[1] == "tally":
        for row in tally_lines(sys.stdin):
            print("\t".join(row))
        return 0
    if len(argv) != 2:
        sys.exit(__doc__)
    counts = read_counts(argv[1])
    if counts is None:
        print("missing")
        return 1
    print(counts["recorded"], counts["dropped"], counts["stackless"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
