"""memsnap: step markers and explicit snapshots for a program run under libmemsnap.so.

Copy this file next to your script (or let ``memsnap run`` put its folder on PYTHONPATH) and:

    import memsnap

    for batch in loader:
        train_step(batch)
        memsnap.step()            # end of a step: MEMSNAP_SKIP/INTERVAL/EVERY/STATS count these

    memsnap.dump("before")        # a snapshot now, tagged "before"; returns once it is on disk
    run_suspect_code()
    memsnap.dump("after")

When the program runs without the preload (no ``LD_PRELOAD=libmemsnap.so``, or ``memsnap run``
was not used), every function is a silent no-op: ``step()`` and ``dump()`` return ``False`` and
``active()`` returns ``False``. Nothing here imports anything beyond the standard library.

The functions look the C API up once, with ``ctypes.CDLL(None)`` (``dlsym(RTLD_DEFAULT, ...)``),
which finds the symbols of a preloaded library. They are safe to call from any thread: the
C functions are thread-safe and the lookup is done once under a lock. ``step()`` costs one
ctypes call (about a microsecond); the library queues a marker and returns.

Return values are honest about what the C API reports:

- ``step()`` -> ``True`` when the marker was recorded. ``False`` without the preload, and also
  before the process's first CUDA allocation: memsnap starts recording on the first
  allocation, and steps before it are not counted (they cannot be, nothing is recording yet).
- ``dump(tag)`` -> ``True`` once the snapshot file is completely written (the C function
  ``memsnap_dump`` blocks until then), ``False`` when memsnap is not loaded, recording is off,
  or the write did not finish in time. The C API does not report the file's path; it is named
  by ``MEMSNAP_FILENAME`` with reason ``api`` and ``{tag}`` (the default name ends in
  ``-api-<seq>.pickle``; put ``{tag}`` in ``MEMSNAP_FILENAME`` to see the tag in the name).
  Use ``last_dump_path()`` for a best-effort guess.
- ``active()`` -> ``True`` while memsnap is recording in this process.
"""

import ctypes
import os
import threading

__all__ = ["step", "dump", "active", "loaded", "last_dump_path"]

_lock = threading.Lock()
_resolved = False
_step = None
_dump = None
_active = None


def _resolve():
    """Looks the C API up once. Returns (step, dump, active), each None when absent."""
    global _resolved, _step, _dump, _active
    if _resolved:
        return _step, _dump, _active
    with _lock:
        if not _resolved:
            try:
                process = ctypes.CDLL(None)
                step_fn = getattr(process, "memsnap_step", None)
                dump_fn = getattr(process, "memsnap_dump", None)
                active_fn = getattr(process, "memsnap_active", None)
            except OSError:
                step_fn = dump_fn = active_fn = None
            if step_fn is not None:
                step_fn.argtypes = []
                step_fn.restype = ctypes.c_int
            if dump_fn is not None:
                dump_fn.argtypes = [ctypes.c_char_p]
                dump_fn.restype = ctypes.c_int
            if active_fn is not None:
                active_fn.argtypes = []
                active_fn.restype = ctypes.c_int
            _step, _dump, _active = step_fn, dump_fn, active_fn
            _resolved = True
    return _step, _dump, _active


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

    Blocks until the file is on disk. Returns True on success, False when memsnap is not
    loaded or not recording, or the write failed or timed out.
    """
    fn = _resolve()[1]
    if fn is None:
        return False
    raw = None if tag is None else str(tag).encode("utf-8", "replace")
    return fn(raw) == 0


def last_dump_path():
    """Best-effort path of the newest explicit (reason ``api``) snapshot of this process.

    Looks in MEMSNAP_FOLDER (default: the current directory) for the newest file whose name,
    under the default MEMSNAP_FILENAME, says ``-p<pid>-api-``. Returns None when there is no
    such file or a custom MEMSNAP_FILENAME is set (its names cannot be recognised reliably),
    or when MEMSNAP_FOLDER uses placeholders.
    """
    if os.environ.get("MEMSNAP_FILENAME", "").strip():
        return None
    folder = os.environ.get("MEMSNAP_FOLDER", "").strip() or "."
    if "{" in folder:
        return None
    needle = "-p%d-api-" % os.getpid()
    best = None
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith(".") or needle not in entry.name:
                    continue
                try:
                    mtime = entry.stat().st_mtime_ns
                except OSError:
                    continue
                if best is None or mtime >= best[0]:
                    best = (mtime, entry.path)
    except OSError:
        return None
    return None if best is None else os.path.abspath(best[1])
