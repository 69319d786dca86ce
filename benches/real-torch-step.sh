#!/usr/bin/env bash
# Instructions a training step, memsnap against PyTorch's own recorder, counted by callgrind:
# the twin of benches/gpu/step_time.py (the step time users feel) that the machine's load
# cannot move, run without a GPU on the simulated CUDA driver.
#
#   bash benches/real-torch-step.sh [LIB...]
#
# LIB: a libmemsnap.so with its symbols (memsnap's writer thread is told apart by its
# function names); without one the script builds one (`cargo build --release --lib
# --features bench-hooks --target-dir target/gpu`, the loop benchmark's build). With two or more
# (two builds of the hot path, say), each gets memsnap's rows, named by the folder it lies in.
# The real PyTorch (${TORCH_VERSION:-2.11.0}, set up by scripts/real-torch/setup.sh into
# ${REAL_TORCH_DIR:-target/real-torch}) runs step_time.py's transformer step (a causal
# language model of 4 encoder layers, d_model 512, batch 16 x 256 tokens, bf16 autocast,
# AdamW) on the simulated driver, where kernels and cuBLAS compute nothing: what is counted is
# the step's host side (Python, autograd, the dispatcher, the allocator, memsnap or the
# recorder), which sets the step time of such a model on a GPU. Each configuration is one
# process under callgrind (benches/python/real_torch_step.py): 5 steps uncounted, STEPS (4)
# counted. Rows: the caching allocator without memsnap, with memsnap (stacks STACKS, default
# "none python all"), with PyTorch's recorder (python, all; context "all", as step_time.py runs
# it); tensor mode (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) without and with memsnap.
# Per step, on the step's threads (the interpreter's and autograd's; memsnap's writer thread
# apart, in its own column): instructions, and what a configuration adds over the same route
# without memsnap, in instructions and in percent of that step. Every memsnap process must end
# with 0 dropped and 0 without a stack on the route its row names: else the row is void and the
# script fails. INTERPRETER_HOOKS=1 adds, without memsnap, the step with an interpreter hook
# that does nothing but be called at every Python call (what Python stacks kept by the
# interpreter instead of read at each allocation would cost, before any work): `sys.monitoring`
# calling C functions at each function's start and return (Python 3.12 and later), and the
# frame-evaluation function of benches/programs/frame_eval_hook.c, which keeps a stack of the
# frames; and prints the Python calls a step. Needs valgrind with its headers, cc, readelf, nm,
# and PyPI for the first run; PYTHON (python3) picks the interpreter. Takes about 6 minutes on
# the 2-core VM (8 with the hooks).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STEPS=${STEPS:-4}
STACKS=${STACKS:-none python all}
NAME=benches/real-torch-step.sh
# (counted_process's program: real_torch_step.py's arguments after MODE STACKS)
PROGRAM=(benches/python/real_torch_step.py)
PROGRAM_ARGS=("$STEPS")
. "$ROOT/benches/support/real_torch_env.sh"
for lib in "${LIBS[@]}"; do
    nm "$lib" 2>/dev/null | grep 'memsnap..writer' >/dev/null \
        || { echo "$NAME: $lib has no symbols (its writer thread could not be told apart): give the unstripped build" >&2; exit 2; }
done

# count NAME MODE STACKS [ENV...]: one process under callgrind; leaves NAME/row.json.
count() {
    counted_process "$@"
    python3 benches/python/real_torch_rows.py step "$WORK/$1" "$1"
}

count_configurations "python all"
if [ "${INTERPRETER_HOOKS:-0}" = 1 ]; then
    include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    cc -O2 -fPIC -shared -I"$include" -o "$WORK/frame_eval_hook.so" benches/programs/frame_eval_hook.c
    if "$PY" -c 'import sys; sys.exit(not hasattr(sys, "monitoring"))'; then
        count hook-monitoring monitoring -
    fi
    count hook-frame-eval frame-eval - FRAME_EVAL_HOOK="$WORK/frame_eval_hook.so"
fi

python3 - "$WORK" "$STEPS" "${LIBS[@]}" <<'PY'
import sys
sys.path.insert(0, "benches/python")
import real_torch_rows
work, steps, libs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
labels = real_torch_rows.labels(libs)
rows = real_torch_rows.load(work)
some = rows["plain"]
print(f"PyTorch {some['torch']} on the simulated driver, Python {some['python']}: step_time.py's "
      f"transformer step, {steps} steps counted a process, "
      f"{some['allocations_per_step']:.0f} allocations a step from the caching allocator; "
      f"{'library' if len(libs) == 1 else 'libraries'} {', '.join(libs)}")
print("instructions a step on the step's threads (memsnap's writer thread apart):")
width = max(24, *(len(f"tensor-memsnap-python{label}") + 2 for label in labels))
print(f"{'configuration':<{width}} {'a step':>13} {'over not loaded':>16} {'':>8} {'writer thread':>14}")


def cells(name, row, base):
    """A row's name, instructions a step, and what it adds over `base` (count and percent)."""
    over = row["step"] - base["step"]
    return f"  {name:<{width - 2}} {row['step']:>13,.0f} {over:>+16,.0f} {100 * over / base['step']:>+7.2f}%"


void = []
for route, prefix, expect in real_torch_rows.ROUTES:
    plain = rows.get(f"{prefix}plain")
    if not plain:
        continue
    print(f"{route}:")
    for name in [f"{prefix}plain"] + real_torch_rows.names(prefix, labels, ("python", "all")):
        row = rows.get(name)
        if not row:
            continue
        row["over"] = row["step"] - plain["step"]
        line = f"{cells(name, row, plain)} {row['writer']:>14,.0f}"
        reason = real_torch_rows.void(row, expect)
        if reason:
            line += reason
            void.append(name)
        if row.get("hook_waits"):
            line += f"  (hooks waited for the writer {row['hook_waits']} times: those waits are in the count)"
        print(line)
for label, stacks, ours, theirs in real_torch_rows.recorder_pairs(rows, labels):
    print(f"the recorder over memsnap{label}, {stacks} stacks, caching allocator: "
          f"{theirs['over'] / ours['over']:.1f}x ({theirs['over']:,.0f} / {ours['over']:,.0f} a step)")
calls = some["python_calls_per_step"]
others = "not counted" if calls["others"] is None else f"{calls['others']:,}"
hooks = [rows[n] for n in ("hook-monitoring", "hook-frame-eval") if n in rows]
if hooks:
    print(f"interpreter hooks doing nothing, no memsnap, caching allocator ({calls['interpreter']:,} "
          f"Python calls a step on the interpreter's thread, {others} on the others):")
    for row in hooks:
        per_call = (row["step"] - some["step"]) / (calls["interpreter"] + (calls["others"] or 0))
        print(f"{cells(row['name'], row, some)} {per_call:>14,.0f} a call")
if void:
    sys.exit(f"void rows (memsnap lost events or took another route): {', '.join(void)}")
PY
