#!/usr/bin/env bash
# `memsnap run` around torchrun on a 2-GPU machine (docs/DESIGN.md, target 4: the launcher under torchrun),
# then `memsnap ranks` and `memsnap summary --json` on what it wrote. Exit 0 when one file
# per rank exists (named r0, r1), the launcher wrote none, and the CLI reads them all.
#
#   bash scripts/gpu/launcher_check.sh      (from the repo root, after validate.sh's build)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
W=$(mktemp -d /tmp/memsnap-launcher.XXXXXX)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=1
unset LD_PRELOAD
M=target/release/memsnap
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${ngpu:-0}" -lt 2 ]; then echo "launcher_check: SKIP (needs 2 GPUs, have ${ngpu:-0})"; exit 0; fi
set -x
timeout 150 "$M" run --folder "$W/snaps" -- python3 -m torch.distributed.run --nproc_per_node=2 \
    --nnodes=1 --master_port=29517 scripts/gpu/workloads.py ddp "$W/truth.json"
rc=$?
set +x
ls -l "$W/snaps"
ok=1
[ "$rc" = 0 ] || { echo "FAIL: memsnap run exited $rc"; ok=0; }
for r in 0 1; do
    n=$(ls "$W/snaps" | grep -c -- "-r$r-p.*-exit-" || true)
    [ "$n" = 1 ] || { echo "FAIL: rank $r wrote $n exit files"; ok=0; }
done
total=$(ls "$W/snaps" | grep -c '\.pickle$' || true)
[ "$total" = 2 ] || { echo "FAIL: $total files (expected 2: the launcher writes none)"; ok=0; }
"$M" ranks "$W/snaps" || { echo "FAIL: memsnap ranks"; ok=0; }
for f in "$W"/snaps/*.pickle; do
    "$M" summary --json "$f" > "$W/summary.json" || { echo "FAIL: memsnap summary $f"; ok=0; }
    "$M" check "$f" || { echo "FAIL: memsnap check $f"; ok=0; }
done
[ "$ok" = 1 ] && echo "launcher_check: PASS" || { echo "launcher_check: FAIL"; exit 1; }
