"""A PyTorch job on a real GPU that meets the signals memsnap borrows (scripts/gpu/signals.py
runs it). Modes (argv[1]):

  lightning   a Lightning fit under a SLURM-looking environment with auto_requeue, so that
              Lightning installs its own SIGUSR1 handler; at batch 3 the job sends itself
              SIGUSR1 and waits for memsnap's snapshot; prints what it saw
  abort       allocates, then os.abort()
  term        allocates, prints ready, sleeps until killed
  faulthandler  allocates, registers faulthandler on SIGUSR1, prints ready, waits on stdin
  compile     a training step compiled with torch.compile(mode="reduce-overhead") (the caller
              gives it cold compile caches), a few steps, prints ready with the signals the
              kernel says it catches, waits on stdin (the caller sends SIGUSR1 meanwhile),
              then more steps, and prints survived
  ctrl-c      allocates, then sends itself SIGINT (what Ctrl-C sends): the KeyboardInterrupt
              ends the job
Prints `result KEY=VALUE` lines.
"""

import os
import signal
import sys
import time

import torch


def signal_files():
    folder = os.environ.get("MEMSNAP_FOLDER", ".")
    return sorted(n for n in os.listdir(folder) if "-signal-" in n and not n.startswith("."))


def hold_memory():
    blocks = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (3, 5, 7)]
    torch.cuda.synchronize()
    return blocks  # ALLOC-LINE


def lightning():
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import SLURMEnvironment

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(256, 256)

        def training_step(self, batch, idx):
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    seen = {}

    class SendSignal(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, idx):
            if idx != 3:
                return
            handler = signal.getsignal(signal.SIGUSR1)
            seen["handler"] = type(handler).__name__
            before = len(signal_files())
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):
                if len(signal_files()) > before:
                    break
                time.sleep(0.01)
            seen["signal_file"] = int(len(signal_files()) > before)

    data = torch.utils.data.TensorDataset(torch.randn(64, 256))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    root = os.environ.get("MEMSNAP_FOLDER", ".")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=root,
        plugins=[SLURMEnvironment(auto_requeue=True)],
        callbacks=[SendSignal()],
    )
    trainer.fit(Model(), loader)
    ckpts = [n for n in os.listdir(root) if n.startswith("hpc_ckpt")]
    print(f"result handler_type={seen.get('handler')}")
    print(f"result signal_file={seen.get('signal_file', 0)}")
    print(f"result lightning_handler_ran={int(bool(ckpts))}")


def caught_signals():
    """The signals the kernel says this process catches (SigCgt in /proc/self/status)."""
    with open("/proc/self/status") as f:
        mask = int(next(l for l in f if l.startswith("SigCgt:")).split()[1], 16)
    return [signal.Signals(n).name for n in range(1, 32) if mask >> (n - 1) & 1 and n in signal.Signals._value2member_map_]


def compiled_training():
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512, device="cuda")

    @torch.compile(mode="reduce-overhead")
    def loss_of(inputs):
        return model(inputs).square().mean()

    def step():
        loss = loss_of(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    before = caught_signals()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    print(f"result caught_before_compile={','.join(before)}")
    print(f"result caught_after_compile={','.join(caught_signals())}")
    print(f"result python_sees_usr1_as={signal.getsignal(signal.SIGUSR1)}")
    print("result ready=1", flush=True)
    sys.stdin.read()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    print("result survived=1", flush=True)


def main():
    mode = sys.argv[1]
    if mode == "lightning":
        lightning()
        return
    if mode == "compile":
        compiled_training()
        return
    blocks = hold_memory()
    if mode == "abort":
        sys.stdout.flush()
        os.abort()  # ABORT-LINE
    elif mode == "term":
        print("result ready=1", flush=True)
        time.sleep(120)
    elif mode == "ctrl-c":
        # A job started in the background by a non-interactive shell inherits SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("result ready=1", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        print("result survived=1", flush=True)
    elif mode == "faulthandler":
        import faulthandler

        with open(os.path.join(os.environ.get("MEMSNAP_FOLDER", "."), "traceback.txt"), "w") as f:
            faulthandler.register(signal.SIGUSR1, file=f)
            print("result ready=1", flush=True)
            sys.stdin.read()
    del blocks


if __name__ == "__main__":
    main()
