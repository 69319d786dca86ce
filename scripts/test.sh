#!/usr/bin/env bash
# The whole test suite; no GPU needed. Builds the simulated CUDA driver and test programs
# itself (needs a C compiler and python3, both checked below).
#
#   bash scripts/test.sh
#
# The tests that load the HTML viewer in headless Chromium (tests/cli.rs, `chromium_*`) and
# those that need a local S3 server (tests/remote.rs, `s3_*`, moto from PyPI, installed here
# into target/tmp/moto-venv) are #[ignore]d for plain `cargo test`; this script runs them
# too when it has their tool, and says so when it has not. Likewise the wheel's tests
# (tests/wheel.rs): this script builds the wheel (scripts/build-wheel.sh: a release build,
# and pip installs the build tools from PyPI into target/wheel-tools) and runs them when
# python3 can make a virtual environment. It ends with the number of tests that passed,
# failed and were ignored.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for tool in cargo cc python3; do
    command -v "$tool" >/dev/null || { echo "scripts/test.sh: $tool is required" >&2; exit 2; }
done
LOG=$(mktemp -d "${TMPDIR:-/tmp}/memsnap-test.XXXXXX")
trap 'rm -rf "$LOG"' EXIT

# Sums the "test result:" lines of a cargo test log: "P passed, F failed, I ignored".
tally() {
    awk '/^test result:/ {
            for (i = 1; i < NF; i++) {
                if ($(i + 1) ~ /^passed/) p += $i
                if ($(i + 1) ~ /^failed/) f += $i
                if ($(i + 1) ~ /^ignored/) g += $i
            }
        }
        END { printf "%d passed, %d failed, %d ignored", p, f, g }' "$1"
}

echo "== cargo fmt --check"
cargo fmt --check
echo "== cargo build (the preload tests need target/debug/libmemsnap.so and memsnap)"
cargo build --workspace --all-targets
echo "== snapshot checker self-test (the viewer's crash conditions)"
python3 tests/python/check_snapshot.py --self-test
echo "== cargo test"
status=0
cargo test --workspace --no-fail-fast 2>&1 | tee "$LOG/test.log" || status=1

chrome=""
for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then chrome=$name; break; fi
done
if [ -n "$chrome" ]; then
    echo "== viewer tests in headless Chromium ($chrome; ignored by plain cargo test)"
    cargo test --test cli -- --ignored chromium_ 2>&1 | tee "$LOG/chromium.log" || status=1
    viewer="headless Chromium: $(tally "$LOG/chromium.log")"
else
    echo "chromium missing: viewer tests ignored"
    viewer="chromium missing: viewer tests ignored"
fi
# The wheel: built (a release build, checked by auditwheel), installed into a fresh virtual
# environment and used from outside the clone (tests/wheel.rs, ignored by plain cargo test).
if python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    echo "== wheel: scripts/build-wheel.sh, then tests/wheel.rs on it in a fresh venv"
    if bash scripts/build-wheel.sh; then
        cargo test --test wheel -- --ignored 2>&1 | tee "$LOG/wheel.log" || status=1
        wheel="wheel: $(tally "$LOG/wheel.log")"
    else
        status=1
        wheel="wheel: scripts/build-wheel.sh FAILED"
    fi
else
    echo "python3 venv (with ensurepip) missing: wheel tests ignored"
    wheel="python3 venv missing: wheel tests ignored"
fi
# The S3 tests (tests/remote.rs, `s3_*`) upload to a local S3-compatible server, moto from
# PyPI, installed once into a venv under target/; ignored by plain cargo test.
MOTO_VENV=target/tmp/moto-venv
if [ ! -x "$MOTO_VENV/bin/moto_server" ]; then
    echo "== installing moto[server] into $MOTO_VENV (the S3 tests' server)"
    rm -rf "$MOTO_VENV"
    python3 -m venv "$MOTO_VENV" && "$MOTO_VENV/bin/pip" install -q "moto[server]" || true
fi
if [ -x "$MOTO_VENV/bin/moto_server" ]; then
    echo "== S3 upload and read tests against moto_server on 127.0.0.1 (ignored by plain cargo test)"
    cargo test --test remote -- --ignored s3_ 2>&1 | tee "$LOG/s3.log" || status=1
    s3="S3 (moto): $(tally "$LOG/s3.log")"
else
    echo "moto could not be installed: S3 tests ignored"
    s3="moto missing: S3 tests ignored"
fi
echo "== tests: cargo test: $(tally "$LOG/test.log"); $viewer; $wheel; $s3"
if [ "$status" -ne 0 ]; then
    echo "scripts/test.sh: FAILED (see above)" >&2
fi
exit "$status"
