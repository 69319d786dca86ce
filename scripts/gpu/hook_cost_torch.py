"""Per-event cost inside real PyTorch, without GPU work to hide it: a Python loop that
allocates and frees a 1 MiB tensor, called from 10 Python frames. In
`backend:cudaMallocAsync` mode every iteration is one cudaMallocAsync + one cudaFreeAsync
(two memsnap events); with the default caching allocator every iteration is two events for
PyTorch's own recorder and none for memsnap (cache hits).

  python3 hook_cost_torch.py            -> prints best-of-5 ns per iteration
Driver (runs every configuration, interleaved, 3 rounds; prints JSON):
  python3 hook_cost_torch.py drive LIBMEMSNAP
"""
import json
import os
import subprocess
import sys
import time

ASYNC = "backend:cudaMallocAsync"
CONFIGS = [
    # name, PYTORCH_CUDA_ALLOC_CONF, memsnap stacks (None = not loaded), torch recorder stacks
    ("async/no-preload", ASYNC, None, None),
    ("async/memsnap-none", ASYNC, "none", None),
    ("async/memsnap-python", ASYNC, "python", None),
    ("async/memsnap-all", ASYNC, "all", None),
    ("default/no-recorder", "", None, None),
    ("default/torch-python", "", None, "python"),
    ("default/torch-all", "", None, "all"),
]


def measure():
    import torch

    rec = os.environ.get("TORCH_RECORDER")
    if rec:
        torch.cuda.memory._record_memory_history(max_entries=100000, stacks=rec)
    torch.empty(1, device="cuda")

    def loop(n):
        t = time.perf_counter_ns()
        for _ in range(n):
            y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            del y
        torch.cuda.synchronize()
        return (time.perf_counter_ns() - t) / n

    def nested(d, n):
        return loop(n) if d <= 1 else nested(d - 1, n) + 0.0

    nested(9, 5000)  # warm-up
    print(f"{min(nested(9, 20000) for _ in range(5)):.1f}")


def drive(lib):
    best = {}
    for rnd in range(3):
        order = CONFIGS if rnd % 2 == 0 else list(reversed(CONFIGS))
        for name, conf, stacks, rec in order:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSNAP_", "LD_PRELOAD", "PYTORCH_CUDA"))}
            if conf:
                env["PYTORCH_CUDA_ALLOC_CONF"] = conf
            if stacks:
                env.update(LD_PRELOAD=lib, MEMSNAP_STACKS=stacks, MEMSNAP_AT_EXIT="0", MEMSNAP_QUIET="1")
            if rec:
                env["TORCH_RECORDER"] = rec
            out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                best.setdefault(name, {"error": out.stderr[-800:]})
                continue
            ns = float(out.stdout.strip().splitlines()[-1])
            cur = best.get(name, {}).get("ns_per_iteration")
            best[name] = {"ns_per_iteration": ns if cur is None else min(cur, ns)}
    base = {"async": best.get("async/no-preload", {}).get("ns_per_iteration"),
            "default": best.get("default/no-recorder", {}).get("ns_per_iteration")}
    for name, row in best.items():
        b = base[name.split("/")[0]]
        if "ns_per_iteration" in row and b and not name.endswith(("no-preload", "no-recorder")):
            row["ns_per_event_over_baseline"] = round((row["ns_per_iteration"] - b) / 2, 1)
    print(json.dumps(best, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "drive":
        drive(sys.argv[2])
    else:
        measure()
