"""How many native frames each walk would have to unwind if it could reuse frames from any of
the last R walks instead of only the previous one: an estimate from a snapshot's stacks.

    python3 benches/python/reuse_depth.py SNAPSHOT.pickle [R ...]   (default R: 1 2 4 ... 512)
    python3 benches/python/reuse_depth.py --paths SNAPSHOT.pickle [W]  (default W: 450)

The native walk (src/capture/native/) unwinds a stack's frames from the innermost until it
meets the previous walk in the same unwinder state, then takes the rest from it. A snapshot
does not keep unwinder states, so this compares frames: two stacks share an outer part when
their native frames, compared by file, function and line from the outermost, are the same;
for each stack with native frames, in record order, the frames it would unwind are its native
depth minus the longest shared outer part with any of the R stacks before it. Python frames
(those of .py files) are left out: the native walk does not see them. The first 512 stacks
are skipped (they have fewer predecessors). Prints, per R: the mean frames unwound, the share
of stacks that would unwind none, and the median.

--paths: how many nodes the native walk's tree of paths (src/capture/native/paths.rs: a node per
frame and the path outside it) needs for these stacks: the distinct outer parts of the
stacks' native frames (each frame with all the frames outside it), over the whole snapshot
and per window of W consecutive stacks (a training step's worth: 450 in the transformer of
benches/gpu/step_time.py). A frame at the same place reached with another stack pointer is
a node of its own in the walk, which a snapshot cannot show: a lower bound.
"""
import pickle
import statistics
import sys


def native_stacks(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    out = []
    for trace in snap.get("device_traces", []):
        for entry in trace:
            frames = entry.get("frames") or []
            native = tuple((fr.get("filename", ""), fr.get("name", ""), fr.get("line", 0))
                           for fr in frames if not str(fr.get("filename", "")).endswith(".py"))
            if native:
                out.append(native)
    return out


def shared_outer(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def distinct_paths(stacks):
    """The distinct outer parts (a frame and every frame outside it) of `stacks`."""
    return {s[k:] for s in stacks for k in range(len(s))}


def paths_main(path, window):
    stacks = native_stacks(path)
    if len(stacks) < window:
        raise SystemExit(f"{path}: {len(stacks)} stacks with native frames; at least {window} needed")
    per_window = [len(distinct_paths(stacks[a:a + window])) for a in range(0, len(stacks) - window + 1, window)]
    print(f"{len(stacks)} stacks with native frames: {len(distinct_paths(stacks))} distinct paths of frames; "
          f"per window of {window} stacks: median {statistics.median(per_window):g}, max {max(per_window)}")


def main(argv):
    if len(argv) >= 3 and argv[1] == "--paths":
        return paths_main(argv[2], int(argv[3]) if len(argv) > 3 else 450)
    if len(argv) < 2:
        raise SystemExit(__doc__)
    stacks = native_stacks(argv[1])
    windows = [int(r) for r in argv[2:]] or [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    skip = 512
    if len(stacks) <= skip:
        raise SystemExit(f"{argv[1]}: {len(stacks)} stacks with native frames; more than {skip} needed")
    print(f"{len(stacks)} stacks with native frames, mean depth "
          f"{statistics.mean(len(s) for s in stacks):.1f}")
    print("| walks kept | frames unwound, mean | stacks unwinding none | median |")
    print("|---|---|---|---|")
    for r in windows:
        unwound = [len(s) - max(shared_outer(s, stacks[i - k]) for k in range(1, r + 1))
                   for i, s in enumerate(stacks) if i >= skip]
        print(f"| {r} | {statistics.mean(unwound):.1f} | "
              f"{100 * sum(u == 0 for u in unwound) / len(unwound):.0f}% | {statistics.median(unwound):g} |")


if __name__ == "__main__":
    main(sys.argv)
