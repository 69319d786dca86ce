"""py_signals.py: a Python program that takes the dump signal (SIGUSR1) for itself after its
first allocation, the way Lightning's SLURM handler and faulthandler.register do, then sends
itself the signal. Allocates through libcudart.so.13 with ctypes.

Modes (argv[1]):
  signal        signal.signal(SIGUSR1, handler): prints the previous handler it was told and
                the handler's calls once the snapshot file is there
  faulthandler  faulthandler.register(SIGUSR1, file=...): prints whether the traceback it
                wrote names this file
  ctrl-c        SIGINT (what Ctrl-C sends) while 2 MiB more are held: Python's
                KeyboardInterrupt ends the program, which Python does by restoring SIGINT's
                default action and sending it to itself
Prints `result KEY=VALUE` lines.
"""

import ctypes
import faulthandler
import os
import signal
import sys
import tempfile
import time

CUDART = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
CUDART.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
CUDART.cudaMalloc.restype = ctypes.c_int

CALLS = []


def allocate(nbytes):
    ptr = ctypes.c_void_p()
    if CUDART.cudaMalloc(ctypes.byref(ptr), nbytes) != 0:
        raise RuntimeError("cudaMalloc failed")
    return ptr.value


def on_usr1(signum, frame):
    CALLS.append((signum, frame is not None))


def signal_files():
    folder = os.environ["MEMSNAP_FOLDER"]
    return [n for n in os.listdir(folder) if "-signal-" in n and not n.startswith(".")]


def wait_for_file():
    for _ in range(500):
        if signal_files():
            return True
        time.sleep(0.01)
    return False


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "signal"
    if mode == "ctrl-c":
        # Started in the background by a non-interactive shell (as CI runners may), Python
        # inherits SIGINT ignored and leaves it so: Ctrl-C's handler is put back here.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    allocate(1 << 20)
    if mode == "signal":
        previous = signal.signal(signal.SIGUSR1, on_usr1)
        print(f"result previous_is_default={int(previous == signal.SIG_DFL)}")
        os.kill(os.getpid(), signal.SIGUSR1)
        found = wait_for_file()
        for _ in range(100):  # the Python-level handler runs between bytecodes
            if CALLS:
                break
            time.sleep(0.01)
        print(f"result signal_file={int(found)}")
        print(f"result calls={len(CALLS)}")
        print(f"result handler_args_ok={int(CALLS == [(signal.SIGUSR1, True)])}")
        print(f"result current_is_ours={int(signal.getsignal(signal.SIGUSR1) is on_usr1)}")
    elif mode == "faulthandler":
        with tempfile.TemporaryFile(mode="w+") as out:
            faulthandler.register(signal.SIGUSR1, file=out, all_threads=False)
            os.kill(os.getpid(), signal.SIGUSR1)
            found = wait_for_file()
            out.seek(0)
            text = out.read()
            faulthandler.unregister(signal.SIGUSR1)
        print(f"result signal_file={int(found)}")
        print(f"result traceback_names_this_file={int('py_signals.py' in text)}")
    elif mode == "ctrl-c":
        held = allocate(2 << 20)
        print(f"result holding={held != 0}", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("result survived=1")
    allocate(2 << 20)


if __name__ == "__main__":
    main()
