#!/usr/bin/env python3
"""`cargo test --workspace`, its test binaries run side by side: scripts/test.sh's test stage.

    python3 scripts/test-binaries.py [--jobs N]

`cargo test` runs one test binary at a time. Most of ours keep about one core busy (programs
run under the library, Python starting, a 60-second upload wait), so on two cores one at a
time left the processors idle about half the stage. This script builds the workspace's test
binaries as `cargo test --workspace` does (`--no-run`, which finds the build stage's
artifacts), then runs up to N of them at once (default 3), the longest known first, each as
cargo runs it: from its package's folder, with the variables cargo sets (CARGO,
CARGO_MANIFEST_DIR, CARGO_PKG_NAME, CARGO_PKG_VERSION, the library path). It runs the binaries
themselves rather than `cargo test -p PACKAGE --test NAME`: a selection of one package resolves
the dependencies' features for it alone and compiled every test binary again. Each binary's
output is printed whole when it ends, after cargo's own `Running SOURCE (BINARY)` line, so the
log reads as `cargo test`'s (scripts/test-tally.py counts it); then the doc-tests (`cargo test
--workspace --doc`). Exit status 1 when any run failed, after all have run (as
`--no-fail-fast`).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor

Binary = namedtuple("Binary", "package version manifest kind name source executable")

# The binaries that take longest on two cores (25 to 75 s each: a build of the library with
# the bench-hooks feature, a 60-second wait, processes that run many programs), started first
# so that none of them is left running alone at the end. Any other order is correct too.
LONGEST_FIRST = ("stacks_python", "remote", "frames_kept", "hostile", "signals", "preload")


def test_binaries():
    """[Binary] of every test binary `cargo test --workspace` runs, longest known first."""
    out = subprocess.run(
        ["cargo", "test", "--workspace", "--no-run", "--message-format=json"],
        stdout=subprocess.PIPE,
        check=True,
        text=True,
    ).stdout
    found = []
    for line in out.splitlines():
        message = json.loads(line)
        if message.get("reason") != "compiler-artifact" or not message["profile"]["test"]:
            continue
        if not message.get("executable"):
            continue
        # "path+file:///.../crates/cli#memsnap-cli@0.1.0", or "...#0.1.0" where the folder
        # has the package's name.
        location, _, name_version = message["package_id"].rpartition("#")
        name, _, version = name_version.rpartition("@")
        if not name:
            name, version = location.rstrip("/").rsplit("/", 1)[-1], name_version
        target = message["target"]
        found.append(Binary(name, version, message["manifest_path"], target["kind"][0],
                            target["name"], target["src_path"], message["executable"]))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    return sorted(found, key=lambda b: rank.get(b.name, len(rank)))


def run(binary):
    """(exit status, output, seconds) of one test binary, run as `cargo test` runs it."""
    package_dir = os.path.dirname(binary.manifest)
    profile_dir = os.path.dirname(os.path.dirname(binary.executable))  # target/debug
    env = dict(os.environ)
    env.update({
        "CARGO": os.environ.get("CARGO") or shutil.which("cargo") or "cargo",
        "CARGO_MANIFEST_DIR": package_dir,
        "CARGO_MANIFEST_PATH": binary.manifest,
        "CARGO_PKG_NAME": binary.package,
        "CARGO_PKG_VERSION": binary.version,
        "LD_LIBRARY_PATH": os.pathsep.join(
            p for p in (os.path.join(profile_dir, "deps"), profile_dir,
                        os.environ.get("LD_LIBRARY_PATH")) if p),
    })
    source = os.path.relpath(binary.source, package_dir)
    header = f"     Running {source} ({os.path.relpath(binary.executable, package_dir)})\n"
    start = time.monotonic()
    done = subprocess.run([binary.executable], cwd=package_dir, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = header + done.stdout.decode(errors="replace")
    return done.returncode, output, time.monotonic() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=3)
    options = parser.parse_args()
    binaries = test_binaries()
    failed = []
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        runs = [(b, pool.submit(run, b)) for b in binaries]
        # Printed in the order they were started, each as soon as it and those before it ended.
        for binary, future in runs:
            status, output, seconds = future.result()
            sys.stdout.write(output)
            print(f"== {binary.name} ({binary.kind} of {binary.package}): {seconds:.1f} s",
                  flush=True)
            if status != 0:
                failed.append(binary.name)
    doc = subprocess.run(["cargo", "test", "--workspace", "--doc", "--no-fail-fast"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    sys.stdout.write(doc.stdout.decode(errors="replace"))
    if doc.returncode != 0:
        failed.append("doc-tests")
    if failed:
        print(f"scripts/test-binaries.py: failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
