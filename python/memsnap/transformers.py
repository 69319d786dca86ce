"""A Hugging Face transformers TrainerCallback that ends a memsnap step after every batch.

    from memsnap.transformers import MemsnapCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[MemsnapCallback()])

Run the script under ``memsnap run`` (or with libmemsnap.so preloaded) and the steps drive
``--skip``/``--interval``/``--every`` and ``--stats``; without the preload the callback does
nothing. Importing this module imports transformers (and through it torch), and nothing
else beyond the standard library.
"""

import memsnap

try:
    from transformers import TrainerCallback
except ModuleNotFoundError as missing:
    # Only a missing transformers is explained here; an error inside an installed one is real.
    if missing.name != "transformers":
        raise
    raise ImportError(
        "memsnap.transformers needs Hugging Face transformers, which is not installed in this "
        "environment (pip install transformers)",
        name="transformers",
    ) from None


class MemsnapCallback(TrainerCallback):
    """Calls ``memsnap.step()`` at the end of every training batch.

    The Trainer calls ``on_step_end`` after each optimizer step and ``on_substep_end`` after
    each other batch of a gradient-accumulation cycle, so with both one memsnap step is one
    batch, as with the Lightning callback (with ``gradient_accumulation_steps=1`` it is also
    the Trainer's ``global_step``). Does nothing when libmemsnap.so is not preloaded.
    """

    def on_substep_end(self, args, state, control, **kwargs):
        memsnap.step()

    def on_step_end(self, args, state, control, **kwargs):
        memsnap.step()
