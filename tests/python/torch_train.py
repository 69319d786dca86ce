"""torch_train.py MODE: a small training loop with the real PyTorch, with no memsnap code
(tests/real_torch.rs runs it on the simulated driver with libmemsnap.so preloaded).

An MLP on random batches, SGD, 20 optimizer steps. MODE:

- `plain`: one batch per optimizer step.
- `accumulate`: gradient accumulation, 4 batches per optimizer step (80 batches).
- `program`: as `plain`, and the program marks each step itself (`memsnap.step()` after its
  optimizer step; the `memsnap` package on PYTHONPATH).
- `lightning`, `lightning_callback`: the same model and data through Lightning's Trainer (20
  training steps), without and with memsnap's Lightning callback. On Lightning's CPU
  accelerator (its GPU one asks the device for values, which the simulated driver's kernels
  never compute), each training step also allocating 1 MiB on the device.
- `trainer`, `trainer_callback`: the same through Hugging Face's Trainer, on the CPU too.

Prints `result optimizer_steps=` (as the framework or the loop counts them) and, where the
program marked steps, `result marks=` (how many of them memsnap recorded).
"""

import sys

import torch

MODE = sys.argv[1]
STEPS = 20
torch.manual_seed(0)


def model():
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
    ).cuda()


def loop(accumulate, mark):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    marks = []
    steps = 0
    for i in range(STEPS * accumulate):
        x = torch.randn(32, 64, device="cuda")
        loss = net(x).square().mean() / accumulate
        loss.backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            steps += 1
            opt.zero_grad()
            if mark is not None:
                marks.append(mark())
    print(f"result optimizer_steps={steps}")
    if mark is not None:
        print(f"result marks={sum(1 for m in marks if m)}")


def lightning(callback):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model()

        def training_step(self, batch, _):
            torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            return self.net(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader([torch.randn(64) for _ in range(32 * STEPS)], batch_size=32)
    callbacks = []
    if callback:
        from memsnap.lightning import MemsnapCallback

        callbacks.append(MemsnapCallback())
    torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Module(), data)
    print(f"result optimizer_steps={trainer.global_step}")


def trainer(callback):
    import transformers

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model()

        def forward(self, x):
            torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            return {"loss": self.net(x).square().mean()}

    data = [{"x": torch.randn(64)} for _ in range(32 * STEPS)]
    callbacks = []
    if callback:
        from memsnap.transformers import MemsnapCallback

        callbacks.append(MemsnapCallback())
    args = transformers.TrainingArguments(
        output_dir="/nonexistent-output", max_steps=STEPS, per_device_train_batch_size=32,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_cpu=True,
    )
    torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    t = transformers.Trainer(model=Net(), args=args, train_dataset=data, callbacks=callbacks)
    t.train()
    print(f"result optimizer_steps={t.state.global_step}")


if MODE in ("plain", "accumulate"):
    loop(4 if MODE == "accumulate" else 1, None)
elif MODE == "program":
    import memsnap

    loop(1, memsnap.step)
elif MODE.startswith("lightning"):
    lightning(MODE.endswith("_callback"))
elif MODE.startswith("trainer"):
    trainer(MODE.endswith("_callback"))
else:
    sys.exit(f"unknown mode {MODE}")
sys.stdout.flush()
