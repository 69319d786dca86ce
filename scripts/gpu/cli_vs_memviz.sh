#!/usr/bin/env bash
# `memsnap summary` next to PyTorch's own `python -m torch.cuda._memory_viz stats` on the same
# files (issue #5's side-by-side figure; torch is only on the GPU machine): the 2.2 MB
# PyTorch fixture and generated memsnap-style files of 1M and 4M events. Wall time and peak
# RSS from /usr/bin/time, best of 3. Prints a Markdown table.
#
#   bash scripts/gpu/cli_vs_memviz.sh
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
W=$(mktemp -d /tmp/memsnap-cli.XXXXXX)
M=target/release/memsnap
python3 tests/chromium/gen_snapshot.py "$W/1M.pickle" --events 1000000 >/dev/null
python3 tests/chromium/gen_snapshot.py "$W/4M.pickle" --events 4000000 >/dev/null
best() { # best <cmd...>: "seconds, MB" of the fastest of 3 runs (wall time, peak RSS via wait4)
    python3 - "$@" <<'PY'
import os, subprocess, sys, time
best = None
for _ in range(3):
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
for f in tests/fixtures/torch/torch-transformer-all-stacks.pickle "$W/1M.pickle" "$W/4M.pickle"; do
    size=$(du -h "$f" | cut -f1)
    echo "| $(basename "$f") | $size | $(best "$M" summary "$f") | $(best python3 -m torch.cuda._memory_viz stats "$f") |"
done
