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
best() { # best <cmd...>: "seconds MB" of the fastest of 3 runs
    local b_s=1e9 b_m=0 s m
    for _ in 1 2 3; do
        /usr/bin/time -f "%e %M" -o "$W/t" "$@" >/dev/null 2>"$W/err" || { echo "failed: $(tail -c 300 "$W/err")"; return; }
        read -r s m <"$W/t"
        if awk -v a="$s" -v b="$b_s" 'BEGIN { exit !(a < b) }'; then b_s=$s; b_m=$m; fi
    done
    echo "$b_s s, $((b_m / 1024)) MB"
}
echo "| file | size | memsnap summary | python -m torch.cuda._memory_viz stats |"
echo "|---|---|---|---|"
for f in tests/fixtures/torch/torch-transformer-all-stacks.pickle "$W/1M.pickle" "$W/4M.pickle"; do
    size=$(du -h "$f" | cut -f1)
    echo "| $(basename "$f") | $size | $(best "$M" summary "$f") | $(best python3 -m torch.cuda._memory_viz stats "$f") |"
done
