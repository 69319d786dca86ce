"""memsnap: step markers and explicit snapshots for a program run under libmemsnap.so.

    import memsnap

    for batch in loader:
        train_step(batch)
        memsnap.step()            # end of a step: MEMSNAP_SKIP/INTERVAL/EVERY/STATS count these

    path = memsnap.dump("before") # a snapshot now, tagged "before"; returns once it is on disk
    run_suspect_code()
    memsnap.dump("after")

In a PyTorch program each optimizer step ends a step without ``step()``; from the first
``step()`` on, only the program's count (``MEMSNAP_STEPS``).

Run the program with the library preloaded (``memsnap run -- python train.py``, or
``LD_PRELOAD=$(python -c 'import memsnap; print(memsnap.library_path())') python train.py``).
Without the preload every function is a silent no-op: ``step()`` and ``active()`` return
``False``, ``dump()`` returns ``None``. Importing this package imports nothing beyond the
standard library (no torch, no framework); the framework callbacks live in
``memsnap.lightning`` and ``memsnap.transformers``.

The functions look the C API up once, with ``ctypes.CDLL(None)`` (``dlsym(RTLD_DEFAULT, ...)``),
which finds the symbols of a preloaded library. They are safe to call from any thread: the
C functions are thread-safe and the lookup is done once under a lock. ``step()`` costs one
ctypes call (about a microsecond); the library queues a marker and returns.

Return values are what the C API reports:

- ``step()`` -> ``True`` when the marker was recorded. ``False`` without the preload, and also
  before the process's first CUDA allocation: memsnap starts recording on the first
  allocation, and steps before it are not counted (nothing is recording yet).
- ``dump(tag)`` -> the absolute path of the snapshot file, once it is completely written
  (``memsnap_dump_path`` blocks until then); ``None`` when memsnap is not loaded, the write
  failed or it did not finish in time. The file is named by ``MEMSNAP_FILENAME`` with reason
  ``api`` and ``{tag}`` = the tag.
- ``active()`` -> ``True`` while memsnap is recording in this process.
- ``loaded()`` -> ``True`` when libmemsnap.so is in this process, recording or not.
- ``library_path()`` -> the libmemsnap.so that came with this package (for ``LD_PRELOAD``).
"""

import ctypes
import os
import threading

from ._locate import library_path

__version__ = "0.1.0"
__all__ = ["step", "dump", "active", "loaded", "library_path"]

# The longest path dump() can return; longer ones (never usable with open() anyway, past
# PATH_MAX) make it return None.
_PATH_BUFFER = 1 << 16

_lock = threading.Lock()
_resolved = False
_step = None
_dump_path = None
_active = None


def _resolve():
    """Looks the C API up once. Returns (step, dump_path, active), each None when absent."""
    global _resolved, _step, _dump_path, _active
    if _resolved:
        return _step, _dump_path, _active
    with _lock:
        if not _resolved:
            try:
                process = ctypes.CDLL(None)
                step_fn = getattr(process, "memsnap_step", None)
                dump_fn = getattr(process, "memsnap_dump_path", None)
                active_fn = getattr(process, "memsnap_active", None)
            except OSError:
                step_fn = dump_fn = active_fn = None
            if step_fn is not None:
                step_fn.argtypes = []
                step_fn.restype = ctypes.c_int
            if dump_fn is not None:
                dump_fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
                dump_fn.restype = ctypes.c_int
            if active_fn is not None:
                active_fn.argtypes = []
                active_fn.restype = ctypes.c_int
            _step, _dump_path, _active = step_fn, dump_fn, active_fn
            _resolved = True
    return _step, _dump_path, _active


def loaded():
    """True when libmemsnap.so is in this process (whether or not it is recording yet)."""
    return _resolve()[0] is not None


def active():
    """True while memsnap is recording in this process (after the first CUDA allocation)."""
    fn = _resolve()[2]
    return bool(fn is not None and fn() == 1)


def step():
    """Marks the end of a training step. Returns True when the marker was recorded."""
    fn = _resolve()[0]
    return bool(fn is not None and fn() == 0)


def dump(tag=None):
    """Writes a snapshot now, tagged ``tag`` (``{tag}`` in MEMSNAP_FILENAME).

    Blocks until the file is on disk and returns its absolute path. Returns None when
    memsnap is not loaded, or the write failed or timed out.
    """
    fn = _resolve()[1]
    if fn is None:
        return None
    raw = None if tag is None else str(tag).encode("utf-8", "replace")
    buffer = ctypes.create_string_buffer(_PATH_BUFFER)
    length = fn(raw, buffer, _PATH_BUFFER)
    if length < 0 or length >= _PATH_BUFFER:
        return None
    return os.fsdecode(buffer.raw[:length])
