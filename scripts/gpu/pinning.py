"""Pinning a measuring thread: one core for the thread that times, every other thread of its
process (memsnap's writer, PyTorch's and CUDA's threads) kept off that core.

Used by benches/gpu/step_time.py (the stepping thread, after its warm-up) and torch_blocks.py's cost
cases (the loop's thread, with --isolate): a thread that the scheduler moves, or that shares
its core with the writer draining the events it records, measures the machine's weather
along with memsnap's cost.
"""

import os
import threading


def pin_main_thread(isolate=False):
    """The calling thread on one core (the third it may use; the same in every process, and
    only one process measures at a time), after the warm-up: threads made earlier
    (autograd's, memsnap's writer) keep the whole machine, or with `isolate` every core but
    that one. Returns (the core or None, the names of the threads moved off it); None on a
    machine of fewer than four CPUs, where nothing is pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return None, []
    try:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < 4:
            return None, []
        os.sched_setaffinity(0, {allowed[2]})
    except OSError:
        return None, []
    return allowed[2], keep_off(set(allowed) - core_of(allowed[2])) if isolate else []


def core_of(cpu):
    """`cpu` and the other hardware threads of its core (its SMT siblings, which share the
    core's execution units and caches), from sysfs; `{cpu}` where sysfs does not say."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus | {cpu}


def keep_off(others):
    """Every thread of this process but the calling one onto the CPUs `others` (all but the
    measuring thread's core, its SMT siblings included): nothing else of the process
    (memsnap's writer, which wakes about once a millisecond while it records; PyTorch's and
    CUDA's threads) runs on the measuring thread's core. Returns their names."""
    me, moved = threading.get_native_id(), []
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        if tid == me:
            continue
        try:
            os.sched_setaffinity(tid, others)
            with open(f"/proc/self/task/{tid}/comm") as f:
                moved.append(f.read().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return moved
