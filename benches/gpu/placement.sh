#!/usr/bin/env bash
# Does the hook's cost depend on where the writer thread runs relative to the program's
# thread? Runs the caching-allocator cost case of torch_blocks.py (memsnap none / python /
# all against PyTorch's recorder, same process switching) with the whole process confined to
# two CPUs: the program's and the writer's threads then share one core's two hardware threads
# ("smt"), sit on two cores of one NUMA node ("node"), or on two nodes ("far"), as far as the
# machine has them (lscpu says). Prints the topology and one cost table per placement.
#
#   bash benches/gpu/placement.sh LIB CLI OUT [ROUNDS=1]
set -uo pipefail
LIB=$1 CLI=$2 OUT=$3 ROUNDS=${4:-1}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
lscpu | grep -E "^(Model name|Socket|Core|Thread|NUMA|CPU\(s\))" || true
# cpu,core,socket,node of every online CPU
mapfile -t CPUS < <(lscpu -p=cpu,core,socket,node | grep -v '^#')
first=${CPUS[0]}
IFS=, read -r c0 core0 sock0 node0 <<<"$first"
smt= node= far=
for line in "${CPUS[@]:1}"; do
    IFS=, read -r c core sock nd <<<"$line"
    if [ "$core" = "$core0" ] && [ "$sock" = "$sock0" ] && [ -z "$smt" ]; then smt=$c; fi
    if [ "$core" != "$core0" ] && [ "$nd" = "$node0" ] && [ -z "$node" ]; then node=$c; fi
    if [ "$nd" != "$node0" ] && [ -z "$far" ]; then far=$c; fi
done
echo "CPU $c0 (core $core0, node $node0); same core: ${smt:-none}; same node: ${node:-none}; other node: ${far:-none}"
for place in smt node far; do
    other=${!place}
    [ -z "$other" ] && { echo "placement $place: not on this machine"; continue; }
    mkdir -p "$OUT/$place"
    echo "placement $place: CPUs $c0,$other"
    taskset -c "$c0,$other" python3 scripts/gpu/torch_blocks.py --lib "$LIB" --cli "$CLI" --out "$OUT/$place" \
        --cases cost --cost-rounds "$ROUNDS" --blocks 16 --iterations 5000 2>&1 | grep -A6 "^cost per block"
done
