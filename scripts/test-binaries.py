#!/usr/bin/env python3
"""`cargo test --workspace`, its test binaries run side by side: scripts/test.sh's test stage.

    python3 scripts/test-binaries.py [--jobs N] [-- ARGS FOR EACH BINARY]

`cargo test` runs one test binary at a time. Here many of them wait more than they compute
(a snapshot request, a program's exit, a 60-second upload wait, a Python interpreter
starting), so on two cores one at a time left the processors idle about half the stage.
This script asks cargo for the workspace's test binaries (built already: `cargo test
--no-run`), then runs `cargo test -p PACKAGE --lib|--bin NAME|--test NAME` for up to N
of them at once (default 3), the longest known first. Cargo holds no lock while tests run,
and each run gets the environment and folder cargo gives it. Each binary's output is
printed whole when it ends, cargo's `Running ...` line first, so the log reads as
`cargo test`'s own (scripts/test-tally.py counts it), followed by the doc-tests (`cargo test
--doc`). Exit status 1 when any run failed, after all have run (as `--no-fail-fast`).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# The binaries that take longest on two cores (35 to 80 s each: a build of the library with
# the bench-hooks feature, processes that run many programs, a 60-second wait), started first
# so that none of them is left running alone at the end. Any other order is correct too.
LONGEST_FIRST = ("stacks_python", "frames_kept", "remote", "preload", "signals", "hostile")


def test_binaries():
    """[(package, kind, name)] of every test binary `cargo test --workspace` would run."""
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
        package = message["package_id"]
        # "path+file:///.../crates/cli#memsnap-cli@0.1.0" or "...#0.1.0" (the folder's name)
        name_version = package.rsplit("#", 1)[-1]
        package = name_version.rsplit("@", 1)[0] if "@" in name_version else \
            package.rsplit("#", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        target = message["target"]
        found.append((package, target["kind"][0], target["name"]))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    return sorted(found, key=lambda b: rank.get(b[2], len(rank)))


def run(binary, args):
    package, kind, name = binary
    # A library's unit tests (the root package's is a cdylib) are selected with --lib.
    select = [f"--{kind}", name] if kind in ("bin", "test") else ["--lib"]
    command = ["cargo", "test", "--no-fail-fast", "-p", package, *select, "--", *args]
    start = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return done.returncode, done.stdout.decode(errors="replace"), time.monotonic() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("args", nargs="*", help="passed to each test binary (after --)")
    options = parser.parse_args()
    binaries = test_binaries()
    failed = []
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        runs = [(b, pool.submit(run, b, options.args)) for b in binaries]
        # Printed in the order they were started, each as soon as it and those before it ended.
        for binary, future in runs:
            status, output, seconds = future.result()
            sys.stdout.write(output)
            print(f"== {binary[2]} ({binary[1]} of {binary[0]}): {seconds:.1f} s", flush=True)
            if status != 0:
                failed.append(binary[2])
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
