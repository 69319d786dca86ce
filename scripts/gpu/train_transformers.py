"""A short Hugging Face Trainer run with memsnap's callback (scripts/gpu/wheel_train.sh runs
it under `memsnap run`). A small MLP defined here (no download: the machine is offline) on
random data, STEPS optimizer steps of one batch each, on one GPU.

Prints `result key=value` lines: the framework and its version, whether the library is
preloaded, and the Trainer's global step at the end. The lines marked `# memsnap-check` are
the ones scripts/gpu/check_train.py looks for in the snapshot's stacks.
"""

import tempfile

import torch
import transformers
from torch import nn
from transformers import Trainer, TrainingArguments

import memsnap
from memsnap.transformers import MemsnapCallback

STEPS = 6
BATCH = 64


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 10))

    def forward(self, x, labels=None):
        logits = self.layers(x)  # memsnap-check
        loss = nn.functional.cross_entropy(logits, labels)  # memsnap-check
        return {"loss": loss, "logits": logits}


class RandomData(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 256)
        self.y = torch.randint(0, 10, (n,))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def main():
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(
            model=Net(),
            args=args,
            train_dataset=RandomData(BATCH * STEPS),
            callbacks=[MemsnapCallback()],
        )
        trainer.train()
    print("result framework=transformers %s" % transformers.__version__)
    print("result loaded=%s" % memsnap.loaded())
    print("result global_step=%d" % trainer.state.global_step)


if __name__ == "__main__":
    main()
