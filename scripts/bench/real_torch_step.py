"""One process of scripts/bench-real-torch-step.sh: the transformer training step of
scripts/gpu/step_time.py (its TorchWorkload, imported: the same model, batch, autocast and
optimizer) on the real PyTorch and the simulated driver, counted by callgrind on every thread
(run under `valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes`).

    python3 real_torch_step.py HELPER_SO memsnap|recorder|plain STACKS STEPS

memsnap: libmemsnap.so is preloaded and records throughout. recorder: no memsnap; PyTorch's
recorder (torch.cuda.memory._record_memory_history with stacks STACKS, context "all", as
step_time.py runs it) is on throughout. plain: no memsnap, nothing recorded. HELPER_SO:
callgrind's client requests (start, stop). The step runs 5 times uncounted (the cache filled,
every stack already sent), then STEPS times counted. The counts are per thread, each thread's
in its own file at the process's end: the shell script sums the step's threads (the
interpreter's and autograd's) and reports memsnap's writer thread apart. (Callgrind dumps and
zeroes only the calling thread's counts on request, so blocks of steps recorded and not
inside one process cannot be told apart on autograd's thread: every configuration is a
process of its own.)

On the simulated driver kernels and cuBLAS compute nothing (scripts/real-torch/setup.sh):
what is counted is the step's host side, which sets the step time of a small model on a GPU
(docs/BENCHMARKS.md), with every allocation and free PyTorch makes for it.

Prints one line, RESULT {json}: the caching allocator's allocations a step and memsnap's
snapshot counts; the instructions are in callgrind's files, which the shell script reads.
"""
import argparse
import ctypes
import json
import os
import platform
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
from step_time import TorchWorkload, add_workload_args  # noqa: E402
from torch_blocks import memsnap_counts  # noqa: E402

warnings.filterwarnings("ignore")  # the simulated device is no architecture PyTorch was built for


def main():
    helper_so, mode, stacks, steps = sys.argv[1:5]
    steps = int(steps)
    workload_args = argparse.ArgumentParser()
    add_workload_args(workload_args)
    wl = TorchWorkload(workload_args.parse_args([]))
    helper = ctypes.CDLL(helper_so)
    if mode == "recorder":
        wl.recorder(stacks)
    for _ in range(5):
        wl.step()
    before = wl.allocations()
    helper.counted_start()
    for _ in range(steps):
        wl.step()
    helper.counted_stop()
    after = wl.allocations()
    out = {"mode": mode, "stacks": stacks, "steps": steps,
           "allocations_per_step": (after - before) / steps if before and after else None,
           "torch": wl.torch.__version__, "python": platform.python_version(),
           "backend": wl.torch.cuda.get_allocator_backend()}
    if mode == "memsnap":
        out.update(memsnap_counts("count"))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
