#!/usr/bin/env bash
# The wheel on a GPU machine, with the frameworks it has: installs target/wheels/memsnap-*.whl
# (built by scripts/build-wheel.sh on a machine with cargo, carried over) into a fresh virtual
# environment that sees the machine's packages (--system-site-packages; --no-deps: the
# machine is offline), then, from a folder outside the clone, trains briefly with memsnap's
# callbacks under `--tensors --skip 2 --interval 2` (one allocation per tensor, so the window
# holds the training step's own allocations):
#
#   lightning     installed `memsnap run`       -> scripts/gpu/train_lightning.py (Trainer.fit)
#   transformers  `python -m memsnap run`       -> scripts/gpu/train_transformers.py (Trainer.train)
#
# and checks each run with scripts/gpu/check_train.py: one `step` snapshot at step 4, whose
# stacks name the training script's marked lines; the exit snapshot counts one step per
# batch (6); `memsnap check` accepts every file.
#
#   OUT=/some/folder bash scripts/gpu/wheel_train.sh     (from the repo root)
#
# Writes $OUT/wheel_train.json (environment and every check) and $OUT/wheel_train.log, and
# copies the snapshots to $OUT/snaps-<name>/. Prints PASS/FAIL per check and a last line
# `wheel_train: PASS` or `wheel_train: FAIL (...)`; exit status 0 only when all passed.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
REPO=$PWD
OUT=${OUT:-/tmp/memsnap-wheel-train-out}
mkdir -p "$OUT"
if [ -z "${WHEEL_TRAIN_LOGGED:-}" ]; then
    # Everything this script prints also goes to the log; the exit status is the script's.
    WHEEL_TRAIN_LOGGED=1 bash "${BASH_SOURCE[0]}" "$@" 2>&1 | tee "$OUT/wheel_train.log"
    exit "${PIPESTATUS[0]}"
fi
W=$(mktemp -d /tmp/memsnap-wheel-train.XXXXXX)
RESULTS=$OUT/wheel_train.json
rm -f "$RESULTS"
unset LD_PRELOAD PYTHONPATH VIRTUAL_ENV
# One GPU: the Hugging Face Trainer would otherwise wrap the model in DataParallel.
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
failed=()

note() { echo "== $*"; }
fail() { echo "FAIL $*"; failed+=("$1"); }

# The environment, for docs/VALIDATION.md.
{
    echo "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
    echo "glibc: $(ldd --version 2>/dev/null | head -n 1)"
    echo "python: $(python3 --version 2>&1)"
    for m in torch lightning pytorch_lightning transformers accelerate; do
        echo "$m: $(python3 -c "import $m; print($m.__version__)" 2>/dev/null || echo missing)"
    done
} | tee "$W/environment.txt"

wheels=(target/wheels/memsnap-*.whl)
if [ "${#wheels[@]}" -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
    echo "wheel_train: FAIL (expected one target/wheels/memsnap-*.whl, found: ${wheels[*]})"
    exit 1
fi
WHEEL=$REPO/${wheels[0]}
note "install $(basename "$WHEEL") into a fresh venv (--system-site-packages, --no-deps)"
VENV=$W/venv
# The machine's python3 may itself be a virtual environment (its torch then lives there, not
# in the system's site-packages): a .pth file in the new venv adds the packages python3 sees.
if python3 -m venv --system-site-packages "$VENV" \
    && "$VENV/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/machine-packages.pth", "w").write("\n".join(sys.argv[1:]) + "\n")' \
        $(python3 -c 'import site; print(" ".join(site.getsitepackages()))') \
    && "$VENV/bin/python" -m pip install --quiet --no-index --no-deps \
        --disable-pip-version-check "$WHEEL"; then
    echo "PASS install: $("$VENV/bin/memsnap" --version)"
else
    echo "wheel_train: FAIL (the wheel did not install)"
    exit 1
fi
lib=$("$VENV/bin/python" -c 'import memsnap; print(memsnap.library_path())' 2>&1)
case "$lib" in
    "$VENV"/*/site-packages/memsnap/libmemsnap.so) echo "PASS library_path: $lib" ;;
    *) fail library_path "memsnap.library_path() = $lib (expected inside $VENV)" ;;
esac

WORK=$W/work
mkdir -p "$WORK"
cp scripts/gpu/train_lightning.py scripts/gpu/train_transformers.py "$WORK/"

# train NAME SCRIPT LAUNCHER...: runs SCRIPT under `LAUNCHER run ...`, then checks the run.
train() {
    local name=$1 script=$2
    shift 2
    note "$name: $* run --tensors --skip 2 --interval 2 -- python $script"
    (cd "$WORK" && timeout 600 "$@" run --tensors --skip 2 --interval 2 \
        --folder "snaps-$name" -- "$VENV/bin/python" "$script") \
        > "$W/$name.out" 2> "$W/$name.err"
    local rc=$?
    tail -n 20 "$W/$name.err"
    grep '^result ' "$W/$name.out"
    [ "$rc" = 0 ] || fail "$name" "memsnap run exited $rc"
    python3 scripts/gpu/check_train.py --name "$name" --folder "$WORK/snaps-$name" \
        --script "$WORK/$script" --stdout "$W/$name.out" --skip 2 --interval 2 --batches 6 \
        --cli "$VENV/bin/memsnap" --json "$RESULTS" || failed+=("$name")
    mkdir -p "$OUT/snaps-$name"
    cp "$WORK/snaps-$name"/*.pickle "$OUT/snaps-$name/" 2>/dev/null || true
}

train lightning train_lightning.py "$VENV/bin/memsnap"
train transformers train_transformers.py "$VENV/bin/python" -m memsnap

python3 - "$RESULTS" "$W/environment.txt" <<'EOF'
import json, sys
path, env = sys.argv[1], sys.argv[2]
try:
    runs = json.load(open(path))
except (OSError, ValueError):
    runs = []
environment = dict(l.rstrip("\n").split(": ", 1) for l in open(env) if ": " in l)
json.dump({"environment": environment, "runs": runs}, open(path, "w"), indent=2)
EOF
if [ "${#failed[@]}" -eq 0 ]; then
    echo "wheel_train: PASS"
else
    echo "wheel_train: FAIL (${failed[*]})"
    exit 1
fi
