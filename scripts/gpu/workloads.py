"""GPU workloads that run WITH libmemsnap.so preloaded; each writes a ground-truth JSON.

    python3 workloads.py MODE TRUTH.json      (MEMSNAP_FOLDER = the folder memsnap writes to)

Modes: torch_train (allocator chosen by the environment), torch_oom, jax, cupy, ddp (under torchrun).
The case drivers in cases.py start these and compare memsnap's snapshots with the truth.
Line numbers of the allocation sites matter: cases.py checks that memsnap's Python frames name
this file and real lines of it.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import snaputil  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
FOLDER = os.environ.get("MEMSNAP_FOLDER", ".")


def write_truth(path, truth):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(truth, f, indent=1, default=str)
    os.replace(tmp, path)


def optional_memsnap_module(truth):
    """The optional Python API (the `memsnap` package): only noted, never imported, so the cases
    test the preload alone."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("memsnap")
        truth["memsnap_module"] = spec.origin if spec else "absent"
    except Exception as e:  # noqa: BLE001
        truth["memsnap_module"] = f"unknown ({type(e).__name__})"


# ----------------------------------------------------------------------------------------------
# PyTorch


def build_model(torch):
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def train_step(torch, model, opt, batch):
    out = model(batch)  # activations allocated here
    loss = out.float().pow(2).mean()
    loss.backward()  # gradients allocated here
    opt.step()  # optimizer state allocated here (first step)
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def known_live_bytes(torch, model, opt, extra=()):
    """Bytes of tensors certainly alive now (parameters, optimizer state, kept tensors),
    counted once per storage."""
    seen = {}

    def add(t):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    for t in extra:
        add(t)
    return sum(seen.values()), len(seen)


def torch_segments():
    import torch

    try:
        snap = torch.cuda.memory._snapshot()
        return [
            {"device": s["device"], "address": s["address"], "total_size": s["total_size"],
             "allocated_size": s.get("allocated_size"), "is_expandable": s.get("is_expandable", False)}
            for s in snap["segments"]
        ], None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


def mode_torch_train(truth):
    import torch

    truth["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    truth["no_caching"] = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "")
    torch.manual_seed(0)
    model, opt = build_model(torch)
    batch = torch.randn(16, 128, 256, device="cuda")
    losses = []
    for _ in range(3):
        losses.append(train_step(torch, model, opt, batch))
    # Step boundary: everything queued has finished; no allocation happens until the dump is done.
    torch.cuda.synchronize()
    truth["memory_allocated"] = torch.cuda.memory_allocated()
    truth["memory_reserved"] = torch.cuda.memory_reserved()
    free, total = torch.cuda.mem_get_info()
    truth["mem_get_info"] = {"free": free, "total": total}
    truth["known_live_bytes"], truth["known_live_storages"] = known_live_bytes(torch, model, opt, [batch] + losses)
    truth["torch_segments"], truth["torch_snapshot_error"] = torch_segments()
    truth["dump"] = snaputil.request_dump(FOLDER)
    for _ in range(2):
        losses.append(train_step(torch, model, opt, batch))
    torch.cuda.synchronize()
    truth["final_loss"] = float(losses[-1])


def mode_torch_oom(truth):
    import torch

    torch.manual_seed(0)
    model, opt = build_model(torch)
    batch = torch.randn(16, 128, 256, device="cuda")
    for _ in range(2):
        train_step(torch, model, opt, batch)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    request = ((free + 4 * GIB) // (2 * MIB) + 1) * (2 * MIB)  # a multiple of 2 MiB: PyTorch keeps it
    truth["mem_get_info"] = {"free": free, "total": total}
    truth["oom_request"] = request
    before = set(snaputil.files_by(FOLDER, reason="oom"))
    truth["oom_files_before"] = sorted(before)

    def step_that_overflows():
        out = model(batch)
        huge = torch.empty(request, dtype=torch.uint8, device="cuda")  # the OOM
        return out, huge

    try:
        step_that_overflows()
        truth["raised"] = False
    except torch.cuda.OutOfMemoryError as e:
        # First thing in the handler: is memsnap's oom file already there?
        at_except = [p for p in snaputil.files_by(FOLDER, reason="oom") if p not in before]
        truth["raised"] = True
        truth["oom_files_at_except"] = at_except
        truth["exception"] = str(e)[:500]
        later, waited = snaputil.wait_for_new(FOLDER, "oom", before, timeout=10.0)
        truth["oom_file_later"] = later
        truth["oom_file_later_wait_s"] = waited if later else None
    # The process goes on training after the OOM, as a real job would.
    train_step(torch, model, opt, batch)
    torch.cuda.synchronize()
    truth["continued_after_oom"] = True


def mode_ddp(truth):
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    t = torch.full((4 * MIB,), float(rank + 1), device="cuda")  # 16 MiB
    dist.all_reduce(t)
    torch.cuda.synchronize()
    extra = [torch.empty(n * MIB, dtype=torch.uint8, device="cuda") for n in (1, 2, 3)]
    dist.barrier()
    truth.update({
        "rank": rank, "local_rank": local_rank, "world_size": world, "pid": os.getpid(),
        "allreduce_value": float(t[0].item()), "allreduce_expected": float(world * (world + 1) / 2),
        "extra": len(extra), "device": torch.cuda.current_device(),
    })
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# JAX and CuPy


def mode_jax(truth):
    import jax
    import jax.numpy as jnp

    truth["backend"] = jax.default_backend()
    truth["devices"] = [str(d) for d in jax.devices()]
    x = jnp.ones((64, 1024, 1024), jnp.float32)  # 256 MiB
    y = (x * 2.0).block_until_ready()
    zs = [jnp.full((n * MIB // 4,), 1.0, jnp.float32).block_until_ready() for n in (1, 3, 7)]
    del x
    s = float(jnp.sum(y))
    live = [y] + zs
    truth["known_live_bytes"] = sum(int(a.nbytes) for a in live)
    truth["sum"] = s
    truth["dump"] = snaputil.request_dump(FOLDER)
    truth["after"] = float(jnp.sum(zs[0]))


def mode_cupy(truth):
    import cupy as cp

    arrs = [cp.ones(n * MIB // 4, dtype=cp.float32) for n in (1, 3, 64)]
    odd = cp.zeros(3 * MIB + 17, dtype=cp.uint8)
    tmp = cp.ones(8 * MIB // 4, dtype=cp.float32)
    del tmp  # back to CuPy's pool, not to the driver
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    truth["known_live_bytes"] = sum(int(a.nbytes) for a in arrs) + int(odd.nbytes)
    truth["pool_used_bytes"] = int(pool.used_bytes())
    truth["pool_total_bytes"] = int(pool.total_bytes())
    truth["dump"] = snaputil.request_dump(FOLDER)
    truth["check"] = float(arrs[0].sum())


MODES = {
    "torch_train": mode_torch_train,
    "torch_oom": mode_torch_oom,
    "ddp": mode_ddp,
    "jax": mode_jax,
    "cupy": mode_cupy,
}


def main():
    mode, truth_path = sys.argv[1], sys.argv[2]
    if mode == "ddp":
        root, ext = os.path.splitext(truth_path)
        truth_path = f"{root}_r{os.environ.get('RANK', '0')}{ext}"
    truth = {"mode": mode, "pid": os.getpid(), "folder": FOLDER, "script": os.path.abspath(__file__),
             "preload": os.environ.get("LD_PRELOAD", "")}
    optional_memsnap_module(truth)
    t0 = time.time()
    try:
        MODES[mode](truth)
        truth["ok"] = True
    except Exception:  # noqa: BLE001
        truth["ok"] = False
        truth["error"] = snaputil.exc_text()
        print(truth["error"], file=sys.stderr, flush=True)
    truth["duration_s"] = time.time() - t0
    write_truth(truth_path, truth)
    sys.exit(0 if truth["ok"] else 1)


if __name__ == "__main__":
    main()
