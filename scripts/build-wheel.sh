#!/usr/bin/env bash
# Builds the Python wheel: libmemsnap.so, the memsnap CLI and the `memsnap` package in one
# file, target/wheels/memsnap-<version>-py3-none-manylinux_2_<N>_x86_64.whl, which installs
# with pip on machines without Rust.
#
#   bash scripts/build-wheel.sh [--tools-only]
#
# Needs cargo and python3 with venv. The build tools (python/requirements-build.txt) go into
# target/wheel-tools, made once and reused. cargo builds the release profile into target/,
# so a later `cargo build --release` reuses it. auditwheel then checks every ELF file of the
# wheel against the manylinux policies (symbol versions of glibc and libgcc_s, linked
# libraries) and tags it with the oldest glibc it runs on; this prints that tag.
# --tools-only: makes target/wheel-tools and stops (scripts/test.sh, while it compiles).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TOOLS=target/wheel-tools
REQUIREMENTS=python/requirements-build.txt
if ! cmp -s "$REQUIREMENTS" "$TOOLS/requirements-build.txt" 2>/dev/null; then
    echo "== build tools into $TOOLS ($REQUIREMENTS)"
    rm -rf "$TOOLS"
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --quiet --disable-pip-version-check -r "$REQUIREMENTS"
    cp "$REQUIREMENTS" "$TOOLS/requirements-build.txt"
fi
[ "${1:-}" != --tools-only ] || exit 0

# The library and the CLI first, in one cargo run: setuptools-rust builds them one after the
# other, and the library's own crate (one code-generation unit: Cargo.toml says why) then
# compiles alone on one core; together, the CLI's dependencies compile beside it. pip's two
# runs find both built (crates/workspace-hack gives every selection the same features).
echo "== cargo build --release of the library and the CLI (a first build takes 3 to 6 minutes on 2 cores)"
cargo build --release --locked -p memsnap -p memsnap-cli

RAW=target/python-build/wheel
rm -rf "$RAW" target/wheels
mkdir -p "$RAW" target/wheels
echo "== pip wheel (setuptools-rust: cargo build --release of the library and the CLI, up to date" \
    "from the build above; cargo's lines follow)"
# pip shows a build backend's output only with -v: its log goes to a file, cargo's lines
# (Compiling, Finished) to the screen as they come, the whole log's end on a failure.
LOG_PIP=target/python-build/pip-wheel.log
set +e
"$TOOLS/bin/python" -m pip wheel -v --disable-pip-version-check --no-build-isolation \
    --no-deps --wheel-dir "$RAW" . 2>&1 | tee "$LOG_PIP" |
    grep --line-buffered -E '^ *(Compiling|Finished) '
pip_status=${PIPESTATUS[0]}
set -e
if [ "$pip_status" -ne 0 ]; then
    tail -n 40 "$LOG_PIP" >&2
    echo "scripts/build-wheel.sh: pip wheel failed (status $pip_status); whole log: $LOG_PIP" >&2
    exit 1
fi

echo "== auditwheel: symbol versions and libraries of the wheel's ELF files"
# auditwheel repair finds nothing to graft (the wheel links only libc, libm, libgcc_s and
# the loader) and gives the wheel the manylinux tag its symbol versions allow.
PATH="$PWD/$TOOLS/bin:$PATH" "$TOOLS/bin/auditwheel" repair --wheel-dir target/wheels \
    "$RAW"/memsnap-*.whl 2>&1 | grep -v '^INFO:' || true
wheel=$(ls target/wheels/memsnap-*-py3-none-manylinux_*_x86_64.whl 2>/dev/null || true)
if [ -z "$wheel" ]; then
    echo "scripts/build-wheel.sh: auditwheel made no manylinux wheel (see above)" >&2
    exit 1
fi
tag=$("$TOOLS/bin/auditwheel" show "$wheel" | tr '\n' ' ' \
    | sed -n 's/.*constrains the platform tag to "\([^"]*\)".*/\1/p')
echo "auditwheel: the symbol versions in the wheel allow $tag (glibc $(echo "$tag" \
    | sed -n 's/^manylinux_\([0-9]*\)_\([0-9]*\)_.*/\1.\2/p') or newer)"
echo "wheel: $wheel ($(du -h "$wheel" | cut -f1))"
