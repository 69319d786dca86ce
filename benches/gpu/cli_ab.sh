#!/usr/bin/env bash
# Two builds of `memsnap summary` on the same generated files, alternating runs: the
# before/after figure for a reader change on this machine. Best of 5, wall time and RSS.
#
#   bash benches/gpu/cli_ab.sh OLD_BINARY NEW_BINARY
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OLD=$1 NEW=$2
W=$(mktemp -d /tmp/memsnap-ab.XXXXXX)
python3 tests/chromium/gen_snapshot.py "$W/1M.pickle" --events 1000000 >/dev/null
python3 tests/chromium/gen_snapshot.py "$W/4M.pickle" --events 4000000 >/dev/null
echo "| file | before | after |"
echo "|---|---|---|"
for f in tests/fixtures/torch/torch-transformer-all-stacks.pickle "$W/1M.pickle" "$W/4M.pickle"; do
    python3 - "$OLD" "$NEW" "$f" <<'PY'
import os, subprocess, sys, time
old, new, f = sys.argv[1:]
best = {old: None, new: None}
for _ in range(5):
    for b in (old, new):
        t0 = time.perf_counter()
        p = subprocess.Popen([b, "summary", f], stdout=subprocess.DEVNULL)
        _, status, ru = os.wait4(p.pid, 0)
        dt = time.perf_counter() - t0
        assert status == 0, (b, f)
        if best[b] is None or dt < best[b][0]:
            best[b] = (dt, ru.ru_maxrss // 1024)
cell = lambda b: f"{best[b][0]:.2f} s, {best[b][1]} MB"
print(f"| {os.path.basename(f)} | {cell(old)} | {cell(new)} |")
PY
done
