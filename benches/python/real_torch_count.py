"""One process of benches/real-torch.sh: the real PyTorch's caching allocator in a loop
of cached tensors, 12 Python frames deep (the loop of scripts/gpu/torch_blocks.py's cost
case), recorded and not recorded in alternating blocks, each block's instructions counted by
callgrind (run under `valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes`).

    python3 real_torch_count.py HELPER_SO memsnap|recorder|plain STACKS ITERATIONS BLOCKS

memsnap: this process has libmemsnap.so preloaded (built with --features bench-hooks) and
switches recording with its memsnap_debug_pass_through, as the GPU benchmark does. recorder:
no memsnap; PyTorch's own recorder (torch.cuda.memory._record_memory_history, stacks "python"
or "all", or "none": its entries without stacks) is switched on and off. plain: no memsnap, nothing recorded in either block (the
loop as a program without memsnap runs it; STACKS is ignored). HELPER_SO is a small library whose functions are
callgrind's client requests (start, zero, dump with a name). Before the counted blocks the
loop runs once uncounted and once counted and discarded, so that the blocks see the steady
state: every tensor from the cache, every stack already sent.

Prints one line, RESULT {json}, with each block's name (on-1, off-1, ...), the events a block
makes and memsnap's snapshot counts (dropped, without a stack, the allocator line); the
instructions are in callgrind's dumps, which the shell script reads.
"""
import ctypes
import json
import os
import platform
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "gpu"))
from torch_blocks import cost_loop, memsnap_counts, recorder_on  # noqa: E402  (the GPU benchmark's own)

warnings.filterwarnings("ignore")  # the simulated device is no architecture PyTorch was built for


def main():
    helper_so, mode, stacks, iterations, blocks = sys.argv[1:6]
    n, blocks = int(iterations), int(blocks)
    import torch
    helper = ctypes.CDLL(helper_so)
    helper.counted_dump.argtypes = [ctypes.c_char_p]
    sizes = [512 * (1 + (i * 37) % 2048) for i in range(256)]
    # (memsnap records the warm-up: its first segment allocation is where it finds PyTorch's
    # allocator and attaches to its tracker.)
    switch = ctypes.CDLL(None).memsnap_debug_pass_through if mode == "memsnap" else None

    def recording(on):
        if switch is not None:
            switch(0 if on else 1)
        elif mode == "plain":
            pass
        elif on:
            recorder_on(torch, stacks)
        else:
            torch.cuda.memory._record_memory_history(enabled=None)

    cost_loop(torch, n, sizes)  # the cache filled: every later tensor comes from it
    helper.counted_start()
    for on in (True, False):  # counted and discarded: the first recorded stacks, the code translated
        recording(on)
        cost_loop(torch, n, sizes)
        recording(False)
    names = []
    for block in range(blocks):
        for on in ((True, False) if block % 2 == 0 else (False, True)):
            recording(on)
            helper.counted_zero()
            cost_loop(torch, n, sizes)
            name = f"{'on' if on else 'off'}-{block + 1}"
            helper.counted_dump(name.encode())
            recording(False)
            names.append(name)
    helper.counted_stop()
    out = {"mode": mode, "stacks": stacks, "iterations": n, "blocks": names,
           "torch": torch.__version__, "python": platform.python_version(), "backend": torch.cuda.get_allocator_backend()}
    if mode == "memsnap":
        out.update(memsnap_counts("count"))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
