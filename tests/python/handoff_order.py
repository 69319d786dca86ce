"""The order of the allocations in a snapshot of tests/programs/handoff.c: which thread made
each allocation on device 0 (a frame named `thread_b`: thread B, else thread A), and how
many times two allocations in a row came from the same thread, where the program's threads
take turns. Prints one JSON object.

    python3 tests/python/handoff_order.py FILE.pickle
"""

import json
import pickle
import sys


def main(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap.get("device_traces", [[]])[0]
    who = [
        "B" if any(fr.get("name") == "thread_b" for fr in e.get("frames", [])) else "A"
        for e in trace
        if e["action"] == "alloc"
    ]
    out_of_turn = sum(1 for a, b in zip(who, who[1:]) if a == b)
    print(json.dumps({"allocs": len(who), "by_b": who.count("B"), "first": who[:1],
                      "out_of_turn": out_of_turn}))


if __name__ == "__main__":
    main(sys.argv[1])
