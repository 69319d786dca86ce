"""py_optimizer_steps.py MODE: a training loop with no memsnap code, against a stand-in of
PyTorch's optimizer module (written by this program into a temporary folder, removed at the
end): `torch.optim.optimizer` with PyTorch's global step hooks (`_global_optimizer_post_hooks`,
`register_optimizer_step_post_hook`, handles numbered by `RemovableHandle.next_id`) and an
`Optimizer` whose `step` calls each hook as `hook(optimizer, args, kwargs)` afterwards, as
PyTorch 2.x's does. `import torch` imports `torch.optim`, as PyTorch's does.

Each iteration allocates 1 MiB through the fake runtime (ctypes) and frees the previous
iteration's. MODE:

- `plain`: 20 iterations, one optimizer step each.
- `accumulate`: 80 iterations, an optimizer step every 4th (gradient accumulation).
- `program`: as `plain`, and the program marks each step itself after its optimizer step
  (`memsnap_step()`, looked up with ctypes when the library is loaded).
- `two`: two optimizers (a generator's and a discriminator's), one step each an iteration.
- `own_hooks`: as `plain`, with a global step hook of the program's own registered before
  its first CUDA call.
- `none`: no `import torch`: 20 iterations with no optimizer.

Prints `result steps=` (optimizer steps taken), `result marks=` (what each `memsnap_step()`
returned, when called), `result torch_imported=`, and `result hooks=` (the numbers of the
handles of the global step hooks the program registers itself: one after its first step and
one at the end, and in `own_hooks` one before the loop), the same with and without the
preload.
"""

import ctypes
import os
import shutil
import sys
import tempfile

STANDIN = {
    "torch/__init__.py": "from torch import optim as optim\n",
    "torch/optim/__init__.py": (
        "from torch.optim.optimizer import Optimizer as Optimizer\n"
        "del optimizer  # noqa: F821 (as PyTorch's __init__ does)\n"
    ),
    "torch/optim/optimizer.py": '''
from collections import OrderedDict

_global_optimizer_post_hooks = OrderedDict()


class RemovableHandle:
    next_id = 0

    def __init__(self, hooks_dict):
        self.hooks_dict = hooks_dict
        self.id = RemovableHandle.next_id
        RemovableHandle.next_id += 1


def register_optimizer_step_post_hook(hook):
    handle = RemovableHandle(_global_optimizer_post_hooks)
    _global_optimizer_post_hooks[handle.id] = hook
    return handle


class Optimizer:
    def __init__(self, name):
        self.name = name
        self.steps = 0

    def step(self, *args, **kwargs):
        self.steps += 1
        for hook in list(_global_optimizer_post_hooks.values()):
            hook(self, (self,) + args, kwargs)
''',
}

MODE = sys.argv[1]
CUDART = ctypes.CDLL(os.environ.get("FAKE_CUDART") or "libcudart.so.13")
CUDART.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
CUDART.cudaMalloc.restype = ctypes.c_int
CUDART.cudaFree.argtypes = [ctypes.c_void_p]
CUDART.cudaFree.restype = ctypes.c_int
MARK = getattr(ctypes.CDLL(None), "memsnap_step", None)


def allocate():
    ptr = ctypes.c_void_p()
    if CUDART.cudaMalloc(ctypes.byref(ptr), 1 << 20) != 0:
        sys.exit("cudaMalloc failed")
    return ptr.value


folder = tempfile.mkdtemp(prefix="standin-torch-")
try:
    for path, text in STANDIN.items():
        os.makedirs(os.path.join(folder, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(folder, path), "w") as f:
            f.write(text)
    sys.path.insert(0, folder)
    optimizers = []
    hooks = []
    if MODE != "none":
        import torch  # noqa: F401

        optimizer = sys.modules["torch.optim.optimizer"]
        if MODE == "own_hooks":
            hooks.append(optimizer.register_optimizer_step_post_hook(lambda *a: None).id)
        optimizers = [torch.optim.Optimizer("generator")]
        if MODE == "two":
            optimizers.append(torch.optim.Optimizer("discriminator"))
    iterations, every = {"accumulate": (80, 4)}.get(MODE, (20, 1))
    marks = []
    last = None
    for i in range(iterations):
        current = allocate()
        if last is not None:
            CUDART.cudaFree(last)
        last = current
        if (i + 1) % every == 0:
            for opt in optimizers:
                opt.step()
            if optimizers and i + 1 == every:
                hooks.append(optimizer.register_optimizer_step_post_hook(lambda *a: None).id)
            if MODE == "program" and MARK is not None:
                marks.append(MARK())
    if optimizers:
        hooks.append(optimizer.register_optimizer_step_post_hook(lambda *a: None).id)
    print(f"result steps={sum(opt.steps for opt in optimizers)}")
    print(f"result marks={','.join(str(m) for m in marks)}")
    print(f"result torch_imported={'torch' in sys.modules}")
    print(f"result hooks={','.join(str(h) for h in hooks)}")
    sys.stdout.flush()
finally:
    shutil.rmtree(folder, ignore_errors=True)
