"""Training curves on runs shorter than Lightning's logging interval."""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ctr_lightning.callbacks.stream_progress_bar import expected_batches


class ShortRunLogging(Callback):
    """Lowers ``log_every_n_steps`` for a run that would otherwise log no training step.

    Lightning logs training metrics every ``log_every_n_steps`` steps (50 by default): a
    run of 12 steps shows no training curve at all. When the steps this fit will take are
    known (``max_steps``, or the epochs' batches) and fewer than the interval, the
    interval becomes a tenth of the run (at least 1), so the curve has about ten points.
    ``ctr-lightning`` adds it unless the Trainer has one.

    Example::

        Trainer(max_steps=12, callbacks=[ShortRunLogging()])   # logs every step
    """

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = planned_steps(trainer)
        interval = trainer.log_every_n_steps
        if steps is None or interval <= 0 or steps >= interval:
            return
        trainer.log_every_n_steps = max(1, steps // 10)
        rank_zero_info(f"log_every_n_steps {interval} -> {trainer.log_every_n_steps}: this run trains {steps} steps")


def planned_steps(trainer: pl.Trainer) -> int | None:
    """The optimizer steps this fit will take from now, where known (None: a run that ends
    on the data's end of a stream, a stop file or a storage limit)."""
    left: float = math.inf
    if trainer.max_steps is not None and trainer.max_steps > 0:
        left = trainer.max_steps - trainer.global_step
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        batches: float = trainer.num_training_batches
        if math.isinf(batches):
            expected = expected_batches(trainer.train_dataloader)
            batches = math.inf if expected is None else expected
        epochs = trainer.max_epochs - trainer.current_epoch
        left = min(left, epochs * batches / max(1, trainer.accumulate_grad_batches))
    return None if math.isinf(left) else max(0, int(left))
