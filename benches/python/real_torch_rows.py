"""What benches/real-torch.sh and benches/real-torch-step.sh share when they read
their processes' rows (WORK/NAME/row.json, one a configuration): each row made from its
process's files, the rows, the libraries' labels, the routes, each route's row names in order,
and the check that voids a memsnap row.
    python3 real_torch_rows.py loop|step WORK/NAME NAME   -> WORK/NAME/row.json (write_row)
"""
import glob
import json
import os
import re
import sys

# (heading, the prefix of its rows' names, what memsnap's allocator line must start with)
ROUTES = (("caching allocator", "", "blocks"), ("tensor mode", "tensor-", "tensors"))


def thread_totals(folder):
    """(memsnap's writer thread, every other thread): the instructions in each thread's file of
    the process's end (`cg.PID-THREAD`, callgrind's --separate-threads; a dump a client asked
    for, `cg.PID.N-THREAD`, is not one), each since the counting started or the thread's last
    dump. The writer thread is told by its own functions or the lanes' reading side, which
    only it runs (a writer that only looked at its lanes while counted is still told apart)."""
    writer, others = 0, 0
    for path in glob.glob(f"{folder}/cg.*-*"):
        if not re.fullmatch(r"cg\.\d+-\d+", os.path.basename(path)):
            continue
        text = open(path).read()
        totals = int(re.search(r"^totals: (\d+)", text, re.M).group(1))
        if re.search(r"^fn=\(\d+\) memsnap::(writer::|channel::lanes::Reader)", text, re.M):
            writer += totals
        else:
            others += totals
    return writer, others


def write_row(kind, folder, name):
    """FOLDER/row.json for one process: the JSON of its last `RESULT ` line (out.txt) with, for
    real-torch.sh's `loop`, the instructions of each block the loop's thread counted, and for
    real-torch-step.sh's `step`, a step's instructions on the step's threads; both with the
    writer thread's."""
    result = json.loads([line for line in open(f"{folder}/out.txt") if line.startswith("RESULT ")][-1][7:])
    if kind == "loop":
        counted = {}
        for path in glob.glob(f"{folder}/cg.*.*-01"):  # the loop's thread, one file per dump
            text = open(path).read()
            block = re.search(r"^desc: Trigger: Client Request: (\S+)", text, re.M).group(1)
            counted[block] = int(re.search(r"^summary: (\d+)", text, re.M).group(1))
        # The writer thread dumps nothing on request: its file of the process's end holds
        # everything it did while counted (the discarded on block and every on block recorded;
        # it idles in the others).
        writer, _ = thread_totals(folder)
        row = {"name": name, "counted": counted, "writer": writer, **result}
    else:
        writer, step = thread_totals(folder)  # no dumps here: one file a thread
        row = {"name": name, "step": step / result["steps"], "writer": writer / result["steps"], **result}
    with open(f"{folder}/row.json", "w") as f:
        json.dump(row, f)


def load(work):
    return {r["name"]: r for r in (json.load(open(p)) for p in glob.glob(f"{work}/*/row.json"))}


def labels(libs):
    """Each library's label in row names: none for one library, @FOLDER for several."""
    return [""] if len(libs) == 1 else ["@" + os.path.basename(os.path.dirname(lib)) for lib in libs]


def names(prefix, labels, recorder_stacks):
    """A route's memsnap rows, then (caching allocator only) the recorder's."""
    out = [f"{prefix}memsnap-{s}{label}" for label in labels for s in ("none", "python", "all")]
    return out + ([f"recorder-{s}" for s in recorder_stacks] if not prefix else [])


def void(row, expect):
    """Why a row is void (a memsnap process that lost events or took another route), or ''."""
    if row["mode"] != "memsnap" or (row.get("dropped") == 0 and row.get("without_stack") == 0
                                    and str(row.get("torch_allocator", "")).startswith(expect)):
        return ""
    return (f"  VOID: dropped {row.get('dropped')}, without a stack {row.get('without_stack')}, "
            f"allocator {row.get('torch_allocator')!r}")


def recorder_pairs(rows, labels):
    """(label, stacks, memsnap's row, the recorder's row) for each pair both processes ran."""
    for label in labels:
        for stacks in ("python", "all"):
            ours, theirs = rows.get(f"memsnap-{stacks}{label}"), rows.get(f"recorder-{stacks}")
            if ours and theirs and ours.get("over", 0) > 0 and "over" in theirs:
                yield label, stacks, ours, theirs


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("loop", "step"):
        sys.exit(__doc__)
    write_row(*sys.argv[1:])
