"""A short PyTorch Lightning fit with memsnap's callback (scripts/gpu/wheel_train.sh runs it
under `memsnap run`). A small MLP on random data, STEPS batches on one GPU.

Prints `result key=value` lines: the framework and its version, whether the library is
preloaded, and the Trainer's global step at the end. The lines marked `# memsnap-check` are
the ones scripts/gpu/check_train.py looks for in the snapshot's stacks.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
except ModuleNotFoundError as missing:  # the same choice as memsnap.lightning makes
    if missing.name not in ("lightning", "lightning.pytorch"):
        raise
    import pytorch_lightning as pl

import memsnap
from memsnap.lightning import MemsnapCallback

STEPS = 6
BATCH = 64


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.layers(x)  # memsnap-check
        return nn.functional.cross_entropy(logits, y)  # memsnap-check

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * STEPS, 256), torch.randint(0, 10, (BATCH * STEPS,)))
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MemsnapCallback()],
    )
    trainer.fit(Net(), DataLoader(data, batch_size=BATCH))
    print("result framework=%s %s" % (pl.__name__, pl.__version__))
    print("result loaded=%s" % memsnap.loaded())
    print("result global_step=%d" % trainer.global_step)


if __name__ == "__main__":
    main()
