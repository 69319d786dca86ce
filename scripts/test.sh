#!/usr/bin/env bash
# The whole test suite; no GPU needed. Builds the simulated CUDA driver and test programs
# itself (needs a C compiler, python3 and node, checked below).
#
#   bash scripts/test.sh
#
# The tests that load the HTML viewer in headless Chromium (tests/cli.rs, `chromium_*`) and
# those that need a local object-store server (tests/remote.rs: `s3_*` on moto from PyPI,
# installed here into target/tmp/moto-venv; `azure_*` on Azurite from npm, in
# target/tmp/azurite, with the azure-storage-blob client from PyPI in target/tmp/azure-venv)
# are #[ignore]d for plain `cargo test`; this script runs them too when it has their tools,
# and says so when it has not. Likewise the wheel's tests
# (tests/wheel.rs): this script builds the wheel (scripts/build-wheel.sh: a release build,
# and pip installs the build tools from PyPI into target/wheel-tools) and runs them when
# python3 can make a virtual environment; scripts/try-simulated.sh's test
# (tests/scripts.rs), which needs the release build; and the real PyTorch's
# (tests/real_torch.rs), which needs its wheel from PyPI (scripts/real-torch/setup.sh). It ends with every test counted once
# (scripts/test-tally.py): an #[ignore]d test this script ran later counts by its result;
# the tests that did not run are listed with why; the last line is "N passed, N failed,
# N skipped" alone, for CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for tool in cargo cc python3 node; do
    command -v "$tool" >/dev/null || { echo "scripts/test.sh: $tool is required" >&2; exit 2; }
done
LOG=$(mktemp -d "${TMPDIR:-/tmp}/memsnap-test.XXXXXX")
FETCH="" REAL_TORCH="" # background jobs, each in a process group of its own
trap 'for job in $FETCH $REAL_TORCH; do kill -- -"$job" 2>/dev/null; done; rm -rf "$LOG"' EXIT
# Tests that find a tool missing leave a record here (tests/common/mod.rs, `skip`).
rm -rf target/tmp/test-skips

# Each stage ends with a line "== NAME: N s", its wall-clock time.
STAGE="" STAGE_START=$SECONDS
stage() { # stage NAME: ends the running stage, if any, and starts NAME ("" for none)
    [ -z "$STAGE" ] || echo "== $STAGE: $((SECONDS - STAGE_START)) s"
    STAGE=$1 STAGE_START=$SECONDS
}

# What the later stages download waits on the network more than on the CPU, so it runs in
# the background while the debug build compiles, and is waited for before the first test runs: the
# real PyTorch (scripts/real-torch/setup.sh: its wheel, about 530 MB, and its requirements
# from PyPI), the object-store tests' servers and client (tests/remote.rs: moto and
# azure-storage-blob from PyPI, Azurite from npm; installed once under target/tmp) and the
# wheel's build tools (PyPI). The real PyTorch's setup leaves its status in $LOG.
MOTO_VENV=target/tmp/moto-venv
AZURE_VENV=target/tmp/azure-venv
AZURITE=target/tmp/azurite
fetch() {
    local s=0
    bash scripts/real-torch/setup.sh target/real-torch > "$LOG/real-torch-setup.txt" 2>&1 || s=$?
    echo "$s" > "$LOG/real-torch-setup.status"
    if [ ! -x "$MOTO_VENV/bin/moto_server" ]; then
        echo "== installing moto[server] into $MOTO_VENV (the S3 tests' server)"
        rm -rf "$MOTO_VENV"
        python3 -m venv "$MOTO_VENV" && "$MOTO_VENV/bin/pip" install -q "moto[server]" || true
    fi
    if ! "$AZURE_VENV/bin/python" -c 'import azure.storage.blob' 2>/dev/null; then
        echo "== installing azure-storage-blob into $AZURE_VENV (the Azure tests' client)"
        rm -rf "$AZURE_VENV"
        python3 -m venv "$AZURE_VENV" && "$AZURE_VENV/bin/pip" install -q azure-storage-blob || rm -rf "$AZURE_VENV"
    fi
    if [ ! -x "$AZURITE/node_modules/.bin/azurite-blob" ] && command -v npm >/dev/null; then
        echo "== installing azurite (npm) into $AZURITE (the Azure tests' server)"
        mkdir -p "$AZURITE" && (cd "$AZURITE" && npm install --no-audit --no-fund --loglevel=error azurite) || rm -rf "$AZURITE"
    fi
    if python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
        bash scripts/build-wheel.sh --tools-only || true
    fi
}
stage fmt
echo "== cargo fmt --check"
cargo fmt --check
stage clippy
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
# Started once cargo has made target/ (with its CACHEDIR.TAG, by which `memsnap run` knows a
# clone's build: crates/cli/src/run.rs), while the debug build compiles.
set -m # (the background job in a process group of its own, ended whole if this script stops early)
fetch > "$LOG/fetch.txt" 2>&1 &
FETCH=$!
set +m
stage build
echo "== cargo build (the preload tests need target/debug/libmemsnap.so and memsnap)"
cargo build --workspace --all-targets
stage downloads
echo "== waiting for the downloads (tests/top.rs times a flood: no test runs under their load)"
wait "$FETCH" || true
FETCH=""
cat "$LOG/fetch.txt"
stage "checker self-test"
echo "== snapshot checker self-test (the viewer's crash conditions)"
python3 tests/python/check_snapshot.py --self-test
stage "cargo test"
echo "== cargo test"
status=0
why=() # --why PREFIX=REASON for scripts/test-tally.py: tests left out for a missing tool
# `cargo test --workspace`, three test binaries at a time (scripts/test-binaries.py says why).
python3 scripts/test-binaries.py 2>&1 | tee "$LOG/test.log" || status=1
# The capture-stats diagnostic build (a cargo feature no other build has: src/capture/stats.rs):
# it must pass clippy too, and its counters' tests run alone and one at a time, since the counters are
# process-wide. The feature includes bench-hooks: the switch that lets every thread pass
# through is tested here too (in a child process of its own), and the drain benchmark's events
# (benches/in_library/writer_drain.rs: every one applied as the writer expects, on both routes).
stage capture-stats
echo "== capture-stats build: clippy, its counters' tests one at a time, the bench-hooks switch and events"
# (Selected with the whole workspace, as the builds above, so that the dependencies' features
# are theirs and only the library itself is compiled again; the other packages' tests have
# none of these names.)
cargo clippy --workspace --all-targets --features memsnap/capture-stats -- -D warnings
cargo test --workspace --lib --features memsnap/capture-stats -- --test-threads=1 capture_stats_ guard::tests::every_thread writer::drain_bench 2>&1 | tee "$LOG/capture-stats.log" || status=1

chrome=""
for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then chrome=$name; break; fi
done
stage chromium
if [ -n "$chrome" ]; then
    echo "== viewer tests in headless Chromium ($chrome; ignored by plain cargo test)"
    cargo test --test cli -- --ignored chromium_ 2>&1 | tee "$LOG/chromium.log" || status=1
else
    echo "chromium missing: viewer tests ignored"
    why+=(--why "chromium_=chromium missing")
fi
# The real PyTorch on the simulated driver (tests/real_torch.rs, ignored by plain cargo test):
# PyTorch's CUDA wheel, about 530 MB from PyPI, set up once in target/real-torch with
# stand-ins for the NVIDIA libraries it links (scripts/real-torch/setup.sh); memsnap's blocks
# (with and without expandable segments, in a transformer's training step too) and
# out-of-memory snapshot against PyTorch's own, `memsnap diff` and `memsnap explain` on a
# leaking training loop and a model out of memory, and tensor mode's route. They start here,
# in the background, three at a time, and their log is shown in the stage "real PyTorch": run
# alone they left a third of the processors idle (Python starting, programs waiting for their
# snapshots), which the wheel's release build below fills.
if [ "$(cat "$LOG/real-torch-setup.status")" = 0 ]; then
    REAL_TORCH_START=$SECONDS
    set -m
    (
        s=0
        cargo test --test real_torch -- --ignored --test-threads=3 > "$LOG/real-torch.log" 2>&1 || s=$?
        echo "$s $((SECONDS - REAL_TORCH_START))" > "$LOG/real-torch.status"
    ) &
    REAL_TORCH=$!
    set +m
fi
stage wheel
# The wheel: built (a release build, checked by auditwheel), installed into a fresh virtual
# environment and used from outside the clone (tests/wheel.rs, ignored by plain cargo test).
if python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    echo "== wheel: scripts/build-wheel.sh, then tests/wheel.rs on it in a fresh venv"
    if bash scripts/build-wheel.sh; then
        cargo test --test wheel -- --ignored 2>&1 | tee "$LOG/wheel.log" || status=1
    else
        status=1
        why+=(--why "wheel::=scripts/build-wheel.sh failed")
    fi
else
    echo "python3 venv (with ensurepip) missing: wheel tests ignored"
    why+=(--why "wheel::=python3 venv (with ensurepip) missing")
fi
# scripts/try-simulated.sh on a C and a Python file (tests/scripts.rs, ignored by plain
# cargo test: it builds the release profile, which the wheel's build above has made).
stage try-simulated
echo "== scripts/try-simulated.sh (tests/scripts.rs; ignored by plain cargo test)"
cargo test --test scripts -- --ignored try_simulated 2>&1 | tee "$LOG/try-simulated.log" || status=1
stage "real PyTorch"
echo "== the real PyTorch on the simulated driver: scripts/real-torch/setup.sh (run above), then tests/real_torch.rs (started before the wheel's build)"
if [ -n "$REAL_TORCH" ]; then
    tail -n 1 "$LOG/real-torch-setup.txt"
    wait "$REAL_TORCH" || true
    REAL_TORCH=""
    cat "$LOG/real-torch.log"
    read -r real_torch_status real_torch_s < "$LOG/real-torch.status" 2>/dev/null \
        || { real_torch_status=1 real_torch_s="?"; echo "tests/real_torch.rs ended without a status"; }
    echo "== tests/real_torch.rs ran $real_torch_s s (beside the stages since the wheel's)"
    [ "$real_torch_status" = 0 ] || status=1
else
    tail -n 5 "$LOG/real-torch-setup.txt"
    echo "the real PyTorch could not be set up (above): its tests ignored"
    why+=(--why "real_torch::=scripts/real-torch/setup.sh failed: no PyPI, pip, unzip, readelf or nm")
fi
# The object-store tests (tests/remote.rs), ignored by plain cargo test, against the servers
# installed above. No GCS emulator takes object_store's writes, so the gs:// tests need no
# server and run with cargo test.
stage "object stores"
# Runs the tests of one server when its tools are there: remote_tests NAME FILTER TOOL...
remote_tests() {
    local name=$1 filter=$2
    shift 2
    for tool in "$@"; do
        if [ ! -x "$tool" ]; then
            echo "$name missing ($tool): $filter tests ignored"
            why+=(--why "$filter=$name missing ($tool)")
            return
        fi
    done
    echo "== $filter tests against $name on 127.0.0.1 (ignored by plain cargo test)"
    cargo test --test remote -- --ignored "$filter" 2>&1 | tee "$LOG/$filter.log" || status=1
}
remote_tests "moto (S3)" s3_ "$MOTO_VENV/bin/moto_server"
remote_tests "Azurite (Azure)" azure_ "$AZURITE/node_modules/.bin/azurite-blob" "$AZURE_VENV/bin/python"
stage ""
echo "== whole suite: $SECONDS s"
echo "== tests, each counted once (an #[ignore]d test run later counts by its result)"
python3 scripts/test-tally.py ${why[@]+"${why[@]}"} --skips target/tmp/test-skips "$LOG"/*.log
if [ "$status" -ne 0 ]; then
    echo "scripts/test.sh: FAILED (see above)" >&2
fi
exit "$status"
