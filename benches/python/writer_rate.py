"""The writer's drain rate of two or more builds, compared on a loaded machine: each round
runs every library once per configuration, each in its own process, interleaved, so that a
burst of load elsewhere hits all of them; prints the median and the spread over rounds.

    python3 benches/python/writer_rate.py [--rounds 5] [--events 4000000] [--route R] LIB.so [LIB.so ...]

A LIB is a libmemsnap.so built with `--features bench-hooks` (its memsnap_debug_bench_writer
entry points are what `cargo bench --bench writer` calls: benches/in_library/writer_drain.rs). The
route R: `cuda` (default), the events of CUDA calls, each allocation and free with its
stack; `blocks`, PyTorch's caching allocator's trace entries, a third each blocks handed out
and frees requested (with stacks) and frees completed (without), inside 64 segments (a
library from before commit 9e004ed has no such entry point). "Writer alone" is the same events
drained in bursts from a filled queue (the one producer thread is slower than the writer); a
library from before 2026-11-26 has no such figure (0). One run:
`python3 benches/python/writer_rate.py --one LIB EVENTS FRAMES STACKS [ROUTE]`.
"""
import argparse
import ctypes
import json
import statistics
import subprocess
import sys

CONFIGS = [(45, 2000), (45, 20000), (57, 20000)]


ENTRY_POINTS = {"cuda": "memsnap_debug_bench_writer", "blocks": "memsnap_debug_bench_writer_blocks"}


def one(lib, events, depth, distinct, route="cuda"):
    so = ctypes.CDLL(lib)
    f = getattr(so, ENTRY_POINTS[route])
    f.argtypes = [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64)]
    f.restype = ctypes.c_uint64
    # Four outputs; a library from before 2026-11-26 fills three (out[3] stays 0: no figure).
    out = (ctypes.c_uint64 * 4)()
    ns = f(events, distinct, depth, out)
    if ns == 0:
        sys.exit(f"{lib}: the run failed (its message above): no figure")
    alone = events / (out[3] / 1e9) if out[3] else 0.0
    print(json.dumps({"per_s": events / (ns / 1e9), "writer_per_s": alone,
                      "interned": out[0], "rss": out[1], "in_full": out[2], "burst_ns": out[3]}))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:7])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--events", type=int, default=4_000_000)
    ap.add_argument("--route", choices=sorted(ENTRY_POINTS), default="cuda")
    ap.add_argument("libs", nargs="+")
    a = ap.parse_args()
    runs = {}
    for _ in range(a.rounds):
        for depth, distinct in CONFIGS:
            for lib in a.libs:
                p = subprocess.run([sys.executable, __file__, "--one", lib, str(a.events), str(depth), str(distinct),
                                    a.route],
                                   capture_output=True, text=True, check=True)
                runs.setdefault((lib, depth, distinct), []).append(json.loads(p.stdout))
    print(f"| library | frames | distinct stacks | events/s applied: median (min-max of {a.rounds}) "
          f"| writer alone, bursts drained from a filled queue: median (min-max) | stacks sent in full "
          f"| resident memory growth, MiB per 1M events |")
    print("|---|---|---|---|---|---|---|")
    for depth, distinct in CONFIGS:
        for lib in a.libs:
            r = runs[(lib, depth, distinct)]
            rates = [x["per_s"] / 1e6 for x in r]
            alone = [x["writer_per_s"] / 1e6 for x in r]
            mib = statistics.median(x["rss"] for x in r) / (1 << 20) / (a.events / 1e6)
            print(f"| {lib} | {depth} | {distinct} | {statistics.median(rates):.2f}M ({min(rates):.2f}-{max(rates):.2f}) "
                  f"| {statistics.median(alone):.2f}M ({min(alone):.2f}-{max(alone):.2f}) "
                  f"| {r[0]['in_full']} | {mib:.2f} |")


if __name__ == "__main__":
    main()
