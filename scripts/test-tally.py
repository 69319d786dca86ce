#!/usr/bin/env python3
"""The closing lines of scripts/test.sh: every test counted once, over all its cargo logs.

    python3 scripts/test-tally.py [--why PREFIX=REASON ...] [--skips FOLDER] LOG...

Each LOG is the output of one `cargo test` run. A test is named by its test binary (the
`Running ...` or `Doc-tests ...` line above it) and its name. `cargo test` ignores the
`#[ignore]`d tests that scripts/test.sh runs afterwards (`--ignored`) with their tools: such
a test counts once, by its later result, not as ignored too. What is still ignored at the
end did not run; it is listed with why, one line per reason: the script's reason when a
`--why PREFIX=REASON` names the start of the test's name or of BINARY::NAME (the script
knows which tool was missing), else the test's own `#[ignore = "..."]` reason. A test that
found its tool missing at run time reports "ok" to cargo and leaves a file BINARY::TEST with the
reason in FOLDER (`--skips`, tests/common/mod.rs's `skip`): it counts as skipped, not passed.

Prints the not-run lines, then one line that CI reads, alone:
    N passed, N failed, N skipped
Exit status 0; scripts/test.sh decides the outcome from cargo's own exit statuses.
"""

import os
import re
import sys

RUNNING = re.compile(r"^\s*Running (?:unittests )?\S+ \((?:.*/)?([^/)]+?)(?:-[0-9a-f]{16})?\)")
DOCTESTS = re.compile(r"^\s*Doc-tests (\S+)")
TEST = re.compile(r"^test (.+?) \.\.\. (ok|FAILED|ignored)(?:, (.*))?$")


def read(path, results):
    binary = "?"
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            m = RUNNING.match(line) or DOCTESTS.match(line)
            if m:
                binary = m.group(1)
                continue
            m = TEST.match(line)
            if not m:
                continue
            name, status, reason = m.group(1), m.group(2), m.group(3) or ""
            key = (binary, name)
            old = results.get(key)
            # A result beats an "ignored" before or after it; a failure beats a pass.
            if old is None or old[0] == "ignored" or status == "FAILED":
                if status != "ignored" or old is None:
                    results[key] = (status, reason)


def skip_records(folder):
    """{(binary, test name): reason} from the files tests/common's skip() left in folder."""
    found = {}
    if folder and os.path.isdir(folder):
        for entry in os.listdir(folder):
            binary, sep, name = entry.partition("::")
            if sep:
                with open(os.path.join(folder, entry), errors="replace") as f:
                    found[(binary, name.rsplit("::", 1)[-1])] = f.read().strip() or "skipped"
    return found


def main(argv):
    why = []
    logs = []
    records = None
    args = iter(argv)
    for arg in args:
        if arg == "--why":
            prefix, _, reason = next(args).partition("=")
            why.append((prefix, reason))
        elif arg == "--skips":
            records = next(args)
        else:
            logs.append(arg)
    results = {}
    for log in logs:
        read(log, results)
    # Tests that found a tool missing said "ok" to cargo and left a record (tests/common's
    # skip): they did not run.
    for (binary, name), reason in skip_records(records).items():
        for key in [k for k in results if k[0] == binary and k[1].rsplit("::", 1)[-1] == name]:
            if results[key][0] == "ok":
                results[key] = ("ignored", reason)
    passed = sum(1 for s, _ in results.values() if s == "ok")
    failed = sorted(f"{b}: {n}" for (b, n), (s, _) in results.items() if s == "FAILED")
    skipped = {}
    for (binary, name), (status, reason) in sorted(results.items()):
        if status != "ignored":
            continue
        short = name.rsplit("::", 1)[-1]
        given = next((r for p, r in why
                      if short.startswith(p) or f"{binary}::{short}".startswith(p)), None)
        skipped.setdefault(given or reason or "ignored, no reason given", []).append(
            f"{binary}::{name}")
    for name in failed:
        print(f"FAILED: {name}")
    for reason, names in sorted(skipped.items()):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        print(f"not run: {len(names)} ({reason}): {shown}")
    print(f"{passed} passed, {len(failed)} failed, {sum(map(len, skipped.values()))} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
