#!/usr/bin/env python3
"""Writes a large, valid memsnap-style snapshot for benchmarks and the 1M-event view test.

Streams pickle opcodes (protocol 4, MEMOIZE/BINGET memo like Python's pickler) instead of
building Python objects, so a 1 GB file takes little memory to write. The history is a
forward-valid cudaMalloc-level trace (docs/FORMAT.md#one-segment-per-allocation:
segment_alloc+alloc, free_requested+free_completed+segment_free), one segment per live
allocation at the end,
mixed native + Python frames (cudart, NCCL, cuBLAS, torch, user code), and a top-level
`memsnap` metadata dict. Frame dicts are always shared; a frame *list* is shared through the
memo with probability --share, else written afresh (PyTorch's files do both).

  python3 gen_snapshot.py OUT.pickle --events 1000000
  python3 gen_snapshot.py OUT.pickle --size 1G
  python3 gen_snapshot.py OUT.pickle --events 1000000 --loop 200   (a loop that leaks)
  python3 gen_snapshot.py OUT.pickle --events 1000000 --torch-tensors

--torch-tensors: PyTorch's allocations (all but NCCL's) are tensors of
`backend:cudaMallocAsync` (cudaMallocAsync / cudaFreeAsync, `memsnap.torch_allocator` says
`tensors: ...`): requests `memsnap whatif` replays through the caching allocator.
"""
import argparse, random, struct, sys

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--events", type=int, default=0, help="stop after this many events")
p.add_argument("--size", default="0", help="stop once the file reaches this size (e.g. 1G)")
p.add_argument("--stacks", type=int, default=20000, help="distinct stacks")
p.add_argument("--share", type=float, default=0.5, help="probability a stack list is shared")
p.add_argument("--live", type=int, default=4000, help="target number of live allocations")
p.add_argument("--rank", type=int, default=0)
p.add_argument("--dropped", type=int, default=0)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--loop", type=int, default=0,
               help="a loop instead of random traffic: N allocations an iteration, freed at its "
                    "end but one 1 MiB allocation (a leak)")
p.add_argument("--torch-tensors", action="store_true", help="PyTorch's allocations are backend:cudaMallocAsync tensors")
a = p.parse_args()
units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
size_limit = int(a.size[:-1]) * units[a.size[-1].upper()] if a.size[-1].upper() in units else int(a.size)
if not a.events and not size_limit:
    sys.exit("give --events or --size")
rng = random.Random(a.seed)

f = open(a.out, "wb", buffering=1 << 22)
w = f.write
memo_n = 0
strings = {}


def memoize():
    global memo_n
    w(b"\x94")
    memo_n += 1
    return memo_n - 1


def get(i):
    w(b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i))


def s(x):
    i = strings.get(x)
    if i is not None:
        return get(i)
    b = x.encode()
    w((b"\x8c" + bytes([len(b)]) if len(b) < 256 else b"X" + struct.pack("<I", len(b))) + b)
    strings[x] = memoize()


def n(v):
    if 0 <= v < 256:
        w(b"K" + bytes([v]))
    elif 0 <= v < 65536:
        w(b"M" + struct.pack("<H", v))
    elif -(1 << 31) <= v < (1 << 31):
        w(b"J" + struct.pack("<i", v))
    else:
        w(b"\x8a\x08" + struct.pack("<q", v))


# Frames: (name, filename, line). Innermost first in every stack.
RUNTIME = [("cudaMalloc", "/usr/local/cuda/lib64/libcudart.so.12", 0), ("cuMemAlloc_v2", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", 0)]
LIBS = {
    "nccl": [("ncclCudaCalloc", "/opt/nccl/lib/libnccl.so.2", 0), ("ncclCommInitRank", "/opt/nccl/lib/libnccl.so.2", 0)],
    "cublas": [("cublasLtMatmulAlgoGetHeuristic", "/usr/local/cuda/lib64/libcublasLt.so.12", 0), ("cublasGemmEx", "/usr/local/cuda/lib64/libcublas.so.12", 0)],
    "torch": [("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long, CUstream_st*)", "/venv/lib/python3.12/site-packages/torch/lib/libc10_cuda.so", 0),
              ("at::native::empty_cuda(c10::ArrayRef<long>)", "/venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so", 0),
              ("at::native::addmm_out_cuda_impl(at::Tensor&, at::Tensor const&)", "/venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so", 0)],
    "app": [("launch_kernels(float*, int)", "/src/app/kernels.cu", 88), ("setup_buffers()", "/src/app/main.cpp", 41)],
}
PY_LIB = [("forward", "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", 125),
          ("_call_impl", "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 1790),
          ("all_reduce", "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", 2806)]
INTERP = [("_PyEval_EvalFrameDefault", "/usr/lib/libpython3.12.so.1.0", 0), ("PyObject_Call", "/usr/lib/libpython3.12.so.1.0", 0)]
frame_memo = {}


def frame(fr):
    i = frame_memo.get(fr)
    if i is not None:
        return get(i)
    w(b"}")
    frame_memo[fr] = memoize()
    w(b"(")
    s("name"); s(fr[0]); s("filename"); s(fr[1]); s("line"); n(fr[2])
    w(b"u")


def make_stack(k):
    r = random.Random(k)
    lib = r.choice(["torch"] * 5 + ["nccl", "cublas", "app"])
    fr = [RUNTIME[0]] + LIBS[lib][: r.randint(1, len(LIBS[lib]))]
    fr += [("at::native::op_%d(at::Tensor const&)" % r.randint(0, 300), "/venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so", 0) for _ in range(r.randint(2, 8))]
    if lib != "app":
        for j in range(r.randint(3, 8)):
            fr += [INTERP[j % 2], r.choice(PY_LIB)]
        fr.append(("train_step", "/srv/job/train.py", 100 + r.randint(0, 60)))
        fr.append(("<module>", "/srv/job/train.py", 200 + r.randint(0, 5)))
    else:
        fr.append(("main", "/src/app/main.cpp", 12))
    return fr, lib


stacks = [make_stack(k) for k in range(a.stacks)]
stack_memo = {}


def frames(k):
    if k in stack_memo and rng.random() < a.share:
        return get(stack_memo[k])
    w(b"]")
    i = memoize()
    stack_memo.setdefault(k, i)
    w(b"(")
    for fr in stacks[k][0]:
        frame(fr)
    w(b"e")


API = {"torch": "cudaMalloc", "nccl": "cuMemAlloc_v2", "cublas": "cudaMallocAsync", "app": "cudaMalloc"}
if a.torch_tensors:
    API = {k: ("cuMemAlloc_v2" if k == "nccl" else "cudaMallocAsync") for k in API}
t0 = 1_795_000_000_000_000


def event(action, addr, size, k, t, api):
    w(b"}")
    memoize()
    w(b"(")
    s("action"); s(action)
    s("addr"); n(addr)
    s("size"); n(size)
    s("stream"); n(0)
    s("time_us"); n(t0 + t)
    s("frames"); frames(k)
    s("user_metadata"); s(api)
    w(b"u")


# Header: {'device_traces': [[...]], 'segments': [...], ...}
w(b"\x80\x04")
w(b"}"); memoize(); w(b"(")
s("device_traces")
w(b"]"); memoize()
w(b"(")
w(b"]"); memoize()
live = {}  # addr -> (size, stack)
bump = 0x7F00_0000_0000
count = 0
batch = 0
SIZES = [512, 4096, 65536, 1 << 20, 2 << 20, 8 << 20, 64 << 20]


def item_done():
    global batch
    batch += 1
    if batch == 1000:
        w(b"e(")
        batch = 0


w(b"(")
t = 0


def do_alloc(k, size):
    global bump, count
    addr = bump
    bump += (size + 511) // 512 * 512
    api = API[stacks[k][1]]
    for act in ("segment_alloc", "alloc"):
        event(act, addr, size, k, t, api); item_done(); count += 1
    live[addr] = (size, k)
    return addr


def do_free(addr):
    global count
    size, k = live.pop(addr)
    api = "cudaFreeAsync" if API[stacks[k][1]] == "cudaMallocAsync" else "cudaFree"
    for act in ("free_requested", "free_completed", "segment_free"):
        event(act, addr, size, k, t, api); item_done(); count += 1


def loop_ops():
    body = [(rng.randrange(len(stacks)), rng.choice(SIZES)) for _ in range(a.loop)]
    leak = rng.randrange(len(stacks))
    while True:
        temps = []
        for k, size in body:
            temps.append(do_alloc(k, size))
            yield
        do_alloc(leak, 1 << 20)
        yield
        for addr in temps:
            do_free(addr)
            yield


ops = loop_ops() if a.loop else None
while True:
    if (a.events and count >= a.events) or (size_limit and f.tell() >= size_limit):
        break
    t += rng.randint(1, 50)
    if ops:
        next(ops)
    elif live and (len(live) > a.live or rng.random() < 0.48):
        do_free(rng.choice(list(live)) if len(live) < 64 else next(iter(live)))
    else:
        k = rng.randrange(len(stacks))
        do_alloc(k, rng.choice(SIZES))
w(b"e")  # last batch
w(b"e")  # closes the MARK before device 0's list: appends it to device_traces
s("segments")
w(b"]"); memoize(); w(b"(")
batch = 0
for addr in sorted(live):
    size, k = live[addr]
    w(b"}"); memoize(); w(b"(")
    s("device"); n(0); s("address"); n(addr); s("total_size"); n(size)
    s("allocated_size"); n(size); s("active_size"); n(size); s("requested_size"); n(size)
    s("stream"); n(0); s("segment_type"); s("large")
    s("segment_pool_id"); n(0); n(0); w(b"\x86"); memoize()
    s("is_expandable"); w(b"\x89")
    s("frames"); frames(k)
    s("blocks"); w(b"]"); memoize(); w(b"(")
    w(b"}"); memoize(); w(b"(")
    s("address"); n(addr); s("size"); n(size); s("requested_size"); n(size)
    s("state"); s("active_allocated"); s("frames"); frames(k)
    w(b"u")
    w(b"e")
    w(b"u")
    item_done()
w(b"e")
s("allocator_settings"); w(b"}"); memoize()
s("external_annotations"); w(b"]"); memoize()
s("memsnap"); w(b"}"); memoize(); w(b"(")
s("dropped_events"); n(a.dropped); s("rank"); n(a.rank); s("pid"); n(4242)
s("host"); s("gen-host"); s("reason"); s("exit")
if a.torch_tensors:
    s("torch_allocator"); s("tensors: PyTorch 2.11.0+cu130 with backend:cudaMallocAsync, each tensor a CUDA allocation")
w(b"u")
w(b"u.")
f.close()
print(f"{a.out}: {count} events, {len(live)} live allocations", file=sys.stderr)
