#!/usr/bin/env bash
# `memsnap summary` next to PyTorch's own `python -m torch.cuda._memory_viz stats` on the same
# files (the side-by-side figure of docs/DESIGN.md, target 3; torch is only on the GPU machine): the 2.2 MB
# PyTorch fixture and generated memsnap-style files of 1M and 4M events, and with BIG=1 a
# generated 1 GB file (about 3 minutes to generate; `_memory_viz` runs once on it). Wall
# time and peak RSS from wait4, best of 3. Prints a Markdown table, a row at a time.
#
#   bash benches/gpu/cli_vs_memviz.sh
#   BIG=1 bash benches/gpu/cli_vs_memviz.sh
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
W=$(mktemp -d /tmp/memsnap-cli.XXXXXX)
M=target/release/memsnap
python3 tests/chromium/gen_snapshot.py "$W/1M.pickle" --events 1000000 >/dev/null
python3 tests/chromium/gen_snapshot.py "$W/4M.pickle" --events 4000000 >/dev/null
FILES=(tests/fixtures/torch/torch-transformer-all-stacks.pickle "$W/1M.pickle" "$W/4M.pickle")
if [ "${BIG:-0}" = 1 ]; then
    python3 tests/chromium/gen_snapshot.py "$W/1G.pickle" --size 1G >/dev/null
    FILES+=("$W/1G.pickle")
fi
best() { # best RUNS <cmd...>: "seconds, MB" of the fastest run (wall time, peak RSS via wait4)
    python3 - "$@" <<'PY'
import os, subprocess, sys, time
best = None
runs = int(sys.argv.pop(1))
for _ in range(runs):
    t0 = time.perf_counter()
    p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    if status != 0:
        print(f"failed ({p.stderr.read()[-200:].decode(errors='replace').strip()})")
        sys.exit(0)
    if best is None or dt < best[0]:
        best = (dt, ru.ru_maxrss // 1024)
print(f"{best[0]:.2f} s, {best[1]} MB")
PY
}
echo "| file | size | memsnap summary | python -m torch.cuda._memory_viz stats |"
echo "|---|---|---|---|"
for f in "${FILES[@]}"; do
    size=$(du -h "$f" | cut -f1)
    runs=3
    [ "$(stat -c %s "$f")" -gt 500000000 ] && runs=1
    echo "| $(basename "$f") | $size | $(best 3 "$M" summary "$f") | $(best $runs python3 -m torch.cuda._memory_viz stats "$f") |"
done
