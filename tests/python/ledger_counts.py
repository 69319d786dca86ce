"""Counts what a (large) snapshot holds, without turning it into JSON: per device the trace
actions, the alloc/free entries without frames, and the live bytes and blocks of the final
segments; plus memsnap's own counters. Prints one JSON object.

    python3 tests/python/ledger_counts.py FILE.pickle
"""

import json
import pickle
import sys
from collections import Counter


def main(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    devices = []
    for trace in snap.get("device_traces", []):
        actions = Counter(e["action"] for e in trace)
        frameless = Counter(e["action"] for e in trace if not e.get("frames"))
        devices.append({"actions": dict(actions), "without_frames": dict(frameless)})
    live = {}
    for seg in snap.get("segments", []):
        d = live.setdefault(str(seg["device"]), {"bytes": 0, "blocks": 0})
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                d["bytes"] += b["size"]
                d["blocks"] += 1
    meta = {k: v for k, v in snap.get("memsnap", {}).items() if isinstance(v, (int, str))}
    print(json.dumps({"devices": devices, "live": live, "memsnap": meta}))


if __name__ == "__main__":
    main(sys.argv[1])
