"""Cache lines (or any callgrind event) counted instruction by instruction inside one library.

    python3 benches/python/lines_by_instruction.py CALLGRIND_OUT LIBRARY PER [--events D1mr,D1mw]
        [--list]

CALLGRIND_OUT must come from `valgrind --tool=callgrind --dump-instr=yes` (with
`--cache-sim=yes` for the miss events). Sums each event over the instructions of LIBRARY (the
path the process loaded it from), divided by PER (the pairs or calls collected), and prints
one line: the sums, space-separated, in the order of --events. With --list, every
instruction with a nonzero count comes first: the counts, its address in the library, the
instruction (objdump) and the source line it was compiled from (addr2line), which is how
docs/HOT-PATH.md names the lines an event waits for.

Why per instruction: a function's inclusive count is wrong wherever callgrind takes a call
for a recursion (memsnap's `cudaMallocAsync` calling the runtime's function of the same
name), and a function's exclusive count leaves out what was inlined into others.
"""
import argparse
import os
import re
import subprocess
import sys
from collections import defaultdict


def counts(path, library, events):
    """{address: [count per event]} over LIBRARY's instructions in a callgrind file."""
    names = {}
    columns = None
    in_library = False
    last = 0
    after_calls = False
    out = defaultdict(lambda: [0] * len(events))

    def name(kind, value):
        # Compressed names: "(id) name" defines, "(id)" refers back. Only objects' names
        # are needed; other lines with names are no cost lines and are passed over below.
        m = re.match(r"\((\d+)\)(?: (.*))?$", value)
        if not m:
            return value
        if m.group(2) is not None:
            names[(kind, m.group(1))] = m.group(2)
        return names.get((kind, m.group(1)), "")

    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("events:"):
                have = line.split()[1:]
                missing = [e for e in events if e not in have]
                if missing:
                    sys.exit(f"{path}: no event {', '.join(missing)} (events: {' '.join(have)})")
                columns = [have.index(e) for e in events]
                continue
            if line.startswith("positions:") and "instr" not in line:
                sys.exit(f"{path}: recorded without --dump-instr=yes")
            key, _, value = line.partition("=")
            if key == "ob":
                in_library = os.path.realpath(name("ob", value)) == library
                continue
            if key == "cob":
                name("ob", value)  # may define a name a later "ob=" refers back to
                continue
            if key == "calls":
                after_calls = True  # the next cost line is the call's inclusive cost
                continue
            fields = line.split()
            if not fields or not re.match(r"^(0x[0-9a-fA-F]+|[+-]\d+|\*)$", fields[0]):
                continue
            a = fields[0]
            if a.startswith("0x"):
                last = int(a, 16)
            elif a[0] in "+-":
                last += int(a)
            if after_calls:
                after_calls = False
                continue
            if in_library and columns is not None:
                values = fields[2:]  # after the address and the source line
                for j, c in enumerate(columns):
                    if c < len(values):
                        out[last][j] += int(values[c])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("callgrind_out")
    p.add_argument("library")
    p.add_argument("per", type=float, help="divide the sums by this (pairs or calls collected)")
    p.add_argument("--events", default="D1mr,D1mw")
    p.add_argument("--list", action="store_true")
    a = p.parse_args()
    events = a.events.split(",")
    # Callgrind names an object by the path it was loaded from, and gives a shared
    # object's instruction addresses as the object's own (those objdump shows).
    by_address = counts(a.callgrind_out, os.path.realpath(a.library), events)
    if a.list:
        disassembly = {}
        dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", a.library],
                              capture_output=True, text=True).stdout
        for l in dump.splitlines():
            m = re.match(r"\s*([0-9a-f]+):\s*(.*)", l)
            if m:
                disassembly[int(m.group(1), 16)] = m.group(2)
        for address in sorted(by_address):
            c = by_address[address]
            if not any(c):
                continue
            src = subprocess.run(["addr2line", "-f", "-C", "-e", a.library, hex(address)],
                                 capture_output=True, text=True).stdout.split("\n")
            where = f"{src[1].rsplit('/', 1)[-1]} {src[0][:60]}" if len(src) > 1 else ""
            shown = " ".join(f"{x / a.per:6.2f}" for x in c)
            print(f"{shown}  {address:x}  {disassembly.get(address, '?')[:56]:56}  {where}")
    totals = [sum(c[j] for c in by_address.values()) / a.per for j in range(len(events))]
    print(" ".join(f"{t:.2f}" for t in totals))


if __name__ == "__main__":
    main()
