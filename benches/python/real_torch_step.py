"""One process of benches/real-torch-step.sh: the transformer training step of
benches/gpu/step_time.py (scripts/gpu/transformer_step.py's TorchWorkload, imported: the same
model, batch, autocast and optimizer) on the real PyTorch and the simulated driver, counted by
callgrind on every thread
(run under `valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes`).

    python3 real_torch_step.py HELPER_SO memsnap|recorder|plain|monitoring|frame-eval STACKS STEPS

memsnap: libmemsnap.so is preloaded and records throughout. recorder: no memsnap; PyTorch's
recorder (torch.cuda.memory._record_memory_history with stacks STACKS, context "all", as
step_time.py runs it) is on throughout. plain: no memsnap, nothing recorded; it also counts
the Python calls a step, the interpreter's thread's and the others' (Python 3.12 and later),
in one more step after the counted ones. monitoring and frame-eval: no memsnap, and an interpreter hook that does nothing,
installed before the first step, to count what a hook on every Python call costs (the way
to Python stacks without walking the frames at each allocation): monitoring, `sys.monitoring`
(Python 3.12 and later) calling C functions of the interpreter's at each function's start and
return; frame-eval, the frame-evaluation function of benches/programs/frame_eval_hook.c (the
library built from it named by FRAME_EVAL_HOOK), which keeps a stack of the frames. HELPER_SO:
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
import operator
import os
import platform
import sys
import threading
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "gpu"))
from transformer_step import TorchWorkload, add_workload_args  # noqa: E402
from torch_blocks import memsnap_counts  # noqa: E402

warnings.filterwarnings("ignore")  # the simulated device is no architecture PyTorch was built for


def install_interpreter_hook(mode):
    """The hook of `mode` (monitoring, frame-eval), doing nothing but be called."""
    if mode == "monitoring":
        tool, events = 3, sys.monitoring.events
        sys.monitoring.use_tool_id(tool, "no-op")
        # C functions of the interpreter's, taking the events' arguments: (code, offset) and
        # (code, offset, value).
        sys.monitoring.register_callback(tool, events.PY_START, operator.is_)
        sys.monitoring.register_callback(tool, events.PY_RETURN, slice)
        sys.monitoring.set_events(tool, events.PY_START | events.PY_RETURN)
    elif mode == "frame-eval":
        ctypes.PyDLL(os.environ["FRAME_EVAL_HOOK"]).install()


def python_calls(wl):
    """Python function calls of one step (the profiler's `call` events: frames evaluated,
    generators' resumptions included): {"interpreter": the interpreter's thread's, "others":
    every other thread's, or None where the interpreter cannot profile threads it did not
    start (before Python 3.12)}."""
    calls = {"interpreter": 0, "others": 0}
    interpreter = threading.get_ident()

    def profile(frame, event, arg):
        if event == "call":
            calls["interpreter" if threading.get_ident() == interpreter else "others"] += 1
    every_thread = hasattr(threading, "setprofile_all_threads")
    if every_thread:
        threading.setprofile_all_threads(profile)
    else:
        sys.setprofile(profile)
    wl.step()
    if every_thread:
        threading.setprofile_all_threads(None)
    else:
        sys.setprofile(None)
        calls["others"] = None
    return calls


def main():
    helper_so, mode, stacks, steps = sys.argv[1:5]
    steps = int(steps)
    install_interpreter_hook(mode)
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
    if mode == "plain":
        out["python_calls_per_step"] = python_calls(wl)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
