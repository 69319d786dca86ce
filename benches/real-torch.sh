#!/usr/bin/env bash
# Instructions per event inside the real PyTorch, memsnap against PyTorch's own recorder,
# counted by callgrind: the twin of the GPU loop of scripts/gpu/torch_blocks.py (--cases
# cost,cost-async) that the machine's load cannot move, run without a GPU on the simulated
# CUDA driver.
#
#   bash benches/real-torch.sh [LIB...]
#
# LIB: a libmemsnap.so built with --features bench-hooks; without one the script builds one
# (`cargo build --release --lib --features bench-hooks --target-dir target/gpu`). With two
# or more (two builds of the hot path, say), each gets memsnap's rows, named by the folder
# it lies in; the processes without memsnap and the recorder's are shared.
# The real PyTorch (the CUDA wheel of PyTorch ${TORCH_VERSION:-2.11.0}, about 530 MB,
# downloaded once) runs on the simulated driver (scripts/real-torch/setup.sh, into
# ${REAL_TORCH_DIR:-target/real-torch}). Each configuration is one process under callgrind
# (benches/python/real_torch_count.py): a loop of tensors 12 Python frames deep, ITERATIONS
# (2,000) allocations a block, each replacing (freeing) an earlier tensor, in BLOCKS (2) pairs
# of alternating blocks, recording on and off: memsnap's by its pass-through switch, the
# recorder's by torch.cuda.memory._record_memory_history. Two routes: PyTorch's caching
# allocator (memsnap's rows, the recorder's, and the loop in a process without memsnap), and
# tensor mode (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: memsnap's rows and the loop
# without memsnap). Per event (an allocation or a free, as the GPU loop counts them: 2 x
# ITERATIONS a block), on the loop's thread:
#   on - off           an on block minus the off block beside it, inside one process (what
#                      the GPU loop measures in ns);
#   on - not loaded    the on blocks against the same loop in a process without memsnap (the
#                      same hash seed in every process): what the user's program pays;
#   not loaded         the off blocks against that loop (what is paid even while not
#                      recording: for memsnap under the caching allocator, PyTorch's own
#                      work of building trace entries for an attached tracker).
# memsnap's writer thread, which turns the events into the snapshot, is not in these: its
# column, apart, is its instructions over the counted part of the process (its idle waits
# in the off blocks included) an event recorded; with native stacks the writer's one-time
# reading of the libraries' symbol tables falls in that part and outweighs the events. Every memsnap process must end
# with 0 dropped and 0 without a stack, on the route its row names: else the row is void and
# the script fails. Needs valgrind with its headers, cc, readelf, nm, and PyPI for the first
# run. STACKS (default "none python all") picks memsnap's rows; the recorder's are none (its
# history of entries without stacks: what building and keeping the entries costs), python and
# all. PYTHON (python3) picks the interpreter, and with it the wheel. Takes about 3
# minutes on the 2-core VM after the download, and 1.5 more for each further library.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ITERATIONS=${ITERATIONS:-2000}
BLOCKS=${BLOCKS:-2}
STACKS=${STACKS:-none python all}
NAME=benches/real-torch.sh
# (counted_process's program: real_torch_count.py's arguments after MODE STACKS)
PROGRAM=(benches/python/real_torch_count.py)
PROGRAM_ARGS=("$ITERATIONS" "$BLOCKS")
PASS_THROUGH=1 # (recording is switched inside each process)
# (LIBS checked, the real PyTorch set up, PY, WORK and the callgrind helper: shared with
# benches/real-torch-step.sh.)
. "$ROOT/benches/support/real_torch_env.sh"

# count NAME MODE STACKS [ENV...]: one process under callgrind; leaves NAME/row.json.
count() {
    counted_process "$@"
    python3 benches/python/real_torch_rows.py loop "$WORK/$1" "$1"
}

count_configurations "none python all"

python3 - "$WORK" "$ITERATIONS" "${LIBS[@]}" <<'PY'
import statistics, sys
sys.path.insert(0, "benches/python")
import real_torch_rows
work, n, libs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
labels = real_torch_rows.labels(libs)
rows = real_torch_rows.load(work)
events = 2 * n  # an allocation and a free an iteration, as the GPU loop counts them


def blocks(row, kind):
    return [v for k, v in sorted(row["counted"].items()) if k.startswith(kind)]


def pairs(row):
    return [(row["counted"][f"on-{i}"] - row["counted"][f"off-{i}"]) / events
            for i in range(1, 1 + len(row["blocks"]) // 2)]


some = next(iter(rows.values()))
print(f"PyTorch {some['torch']} on the simulated driver, Python {some['python']}, "
      f"{n} allocations a block, {len(some['blocks']) // 2} pairs of blocks; "
      f"{'library' if len(libs) == 1 else 'libraries'} {', '.join(libs)}")
print("instructions an event (an allocation or a free) on the loop's thread:")
width = max(22, *(len(f"tensor-memsnap-python{label}") + 2 for label in labels))
print(f"{'configuration':<{width}} {'on - off':>9} {'each pair':<20} {'on - not loaded':>15} {'not loaded':>11} {'writer':>7}")
void = []
for route, prefix, expect in real_torch_rows.ROUTES:
    plain = rows.get(f"{prefix}plain")
    if not plain:
        continue
    base = statistics.median(blocks(plain, "")) / events
    print(f"{route}: the loop alone {base:,.1f}")
    for name in real_torch_rows.names(prefix, labels, ("none", "python", "all")):
        row = rows.get(name)
        if not row:
            continue
        within = pairs(row)
        over = statistics.median(blocks(row, "on")) / events - base
        row["within"], row["over"] = statistics.median(within), over
        # The writer's work an event recorded: the discarded on block and one on block a pair.
        recorded = (1 + len(row["blocks"]) // 2) * events
        writer = f"{row['writer'] / recorded:>7.1f}" if row["mode"] == "memsnap" else ""
        line = (f"  {name:<{width - 2}} {statistics.median(within):>9.1f} {', '.join(f'{p:.1f}' for p in within):<20} "
                f"{over:>15.1f} {statistics.median(blocks(row, 'off')) / events - base:>+11.1f} {writer}")
        reason = real_torch_rows.void(row, expect)
        if reason:
            line += reason
            void.append(name)
        print(line)
print("(on - off: recording's on/off difference inside the process, as the GPU loop measures it; "
      "on - not loaded: the recorded block against the same loop in a process without memsnap, "
      "what a user's program pays; not loaded: the off block against that loop; writer: memsnap's "
      "writer thread, on its own core, an event recorded, its waits between the blocks included; "
      "with native stacks it is its one-time reading of the libraries' symbol tables, about 530 "
      "million instructions for PyTorch's, which falls in the counted part.)")
for label, stacks, ours, theirs in real_torch_rows.recorder_pairs(rows, labels):
    print(f"the recorder over memsnap{label}, {stacks} stacks, caching allocator: {theirs['over'] / ours['over']:.1f}x "
          f"over not loaded ({theirs['over']:,.0f} / {ours['over']:,.0f}), {theirs['within'] / ours['within']:.1f}x on - off")
if void:
    sys.exit(f"void rows (memsnap lost events or took another route): {', '.join(void)}")
PY
