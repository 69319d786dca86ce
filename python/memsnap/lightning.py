"""A PyTorch Lightning callback that ends a memsnap step after every training batch.

    from memsnap.lightning import MemsnapCallback
    trainer = Trainer(callbacks=[MemsnapCallback()])

Run the script under ``memsnap run`` (or with libmemsnap.so preloaded) and the steps drive
``--skip``/``--interval``/``--every`` and ``--stats``; without the preload the callback does
nothing. Built on ``lightning.pytorch`` when the ``lightning`` package is installed, else on
``pytorch_lightning``. Importing this module imports Lightning (and through it torch), and
nothing else beyond the standard library.
"""

import memsnap


def _callback_base():
    """Lightning's Callback class; ImportError naming the package when Lightning is missing."""
    try:
        from lightning.pytorch import Callback
    except ModuleNotFoundError as missing:
        # Only a missing Lightning falls through; an error inside an installed one is real.
        if missing.name not in ("lightning", "lightning.pytorch"):
            raise
    else:
        return Callback
    try:
        from pytorch_lightning import Callback
    except ModuleNotFoundError as missing:
        if missing.name != "pytorch_lightning":
            raise
        raise ImportError(
            "memsnap.lightning needs PyTorch Lightning, which is not installed in this "
            "environment (pip install lightning)",
            name="lightning",
        ) from None
    return Callback


class MemsnapCallback(_callback_base()):
    """Calls ``memsnap.step()`` at the end of every training batch.

    One memsnap step per batch, also under gradient accumulation (Lightning calls
    ``on_train_batch_end`` once per batch). Does nothing when libmemsnap.so is not preloaded.
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        memsnap.step()
