"""py_callbacks.py: memsnap.lightning and memsnap.transformers against stand-ins of the two
frameworks (written by this program into a temporary folder; the real ones are tried on a
GPU machine by scripts/gpu/wheel_train.sh).

Runs four cases, each in a fresh interpreter, and prints their `result` lines:

- `missing_*`: the framework is not installed (an import hook hides any real one): the
  ImportError's message.
- `broken_*`: the framework is installed but fails inside (a dependency of its own is
  missing): that error, not memsnap's message (`ModuleNotFoundError:<name>`).
- `fallback_base`: only `pytorch_lightning` installed: the callback's base class.
- `lightning_pulls_transformers` / `transformers_pulls_lightning`: both installed; whether
  importing one module imported the other framework.
- the training case, in this process: both frameworks installed; `*_base` are the callbacks'
  base classes. Then 3 CUDA allocations, each followed
  by the Lightning callback's batch end, and 3 more with the Trainer callback (two
  gradient-accumulation substeps and one optimizer step): 6 memsnap steps when preloaded.
"""

import ctypes
import os
import subprocess
import sys
import tempfile

STUBS = {
    "full/lightning/__init__.py": "",
    "full/lightning/pytorch/__init__.py": "class Callback:\n    pass\n",
    "full/transformers/__init__.py": "class TrainerCallback:\n    pass\n",
    "pl/pytorch_lightning/__init__.py": "class Callback:\n    pass\n",
    "broken/lightning/__init__.py": "",
    "broken/lightning/pytorch/__init__.py": "import lightning_utilities_missing\n",
    "broken/transformers/__init__.py": "import tokenizers_missing\n",
}

HIDE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError("No module named %r" % name, name=name)
        return None
sys.meta_path.insert(0, Hide())
"""

CASES = {
    "missing": (None, ("lightning", "pytorch_lightning", "transformers")),
    "broken": ("broken", ()),
    "fallback": ("pl", ("lightning",)),
    "only_lightning": ("full", ()),
    "only_transformers": ("full", ()),
}


def import_error(module):
    try:
        __import__(module)
    except ImportError as e:
        if type(e) is ImportError:
            return str(e)
        return "%s:%s" % (type(e).__name__, e.name)
    return "imported"


def child(case):
    if case == "missing":
        print("result missing_lightning=%s" % import_error("memsnap.lightning"))
        print("result missing_transformers=%s" % import_error("memsnap.transformers"))
    elif case == "broken":
        print("result broken_lightning=%s" % import_error("memsnap.lightning"))
        print("result broken_transformers=%s" % import_error("memsnap.transformers"))
    elif case == "fallback":
        from memsnap.lightning import MemsnapCallback

        base = MemsnapCallback.__mro__[1]
        print("result fallback_base=%s.%s" % (base.__module__, base.__name__))
    elif case == "only_lightning":
        import memsnap.lightning  # noqa: F401

        print("result lightning_pulls_transformers=%s" % ("transformers" in sys.modules))
    elif case == "only_transformers":
        import memsnap.transformers  # noqa: F401

        print("result transformers_pulls_lightning=%s" % ("lightning" in sys.modules))


def main():
    # Removed when done: a test run must leave nothing in /tmp.
    with tempfile.TemporaryDirectory(prefix="memsnap-stubs-") as stubs:
        run_cases(stubs)


def run_cases(stubs):
    for rel, text in STUBS.items():
        path = os.path.join(stubs, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    for case, (folder, hidden) in CASES.items():
        code = HIDE.format(hidden=hidden)
        if folder:
            code += "sys.path.insert(0, %r)\n" % os.path.join(stubs, folder)
        code += "sys.argv = ['py_callbacks.py', %r]\n" % case
        code += "exec(compile(open(%r).read(), %r, 'exec'))\n" % (__file__, __file__)
        out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, check=True)
        sys.stdout.write(out.stdout.decode())

    sys.path.insert(0, os.path.join(stubs, "full"))
    from memsnap.lightning import MemsnapCallback as LightningCallback
    from memsnap.transformers import MemsnapCallback as TrainerCallback

    for name, cls in (("lightning", LightningCallback), ("transformers", TrainerCallback)):
        base = cls.__mro__[1]
        print("result %s_base=%s.%s" % (name, base.__module__, base.__name__))

    cudart = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
    cudart.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    cudart.cudaMalloc.restype = ctypes.c_int
    kept = []

    def allocate():
        ptr = ctypes.c_void_p()
        if cudart.cudaMalloc(ctypes.byref(ptr), 1 << 20) != 0:
            sys.exit("cudaMalloc failed")
        kept.append(ptr.value)

    lightning = LightningCallback()
    for batch_idx in range(3):
        allocate()
        lightning.on_train_batch_end(None, None, None, None, batch_idx)
    trainer = TrainerCallback()
    for hook in (trainer.on_substep_end, trainer.on_substep_end, trainer.on_step_end):
        allocate()
        hook(None, None, None)
    sys.stdout.flush()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    else:
        main()
