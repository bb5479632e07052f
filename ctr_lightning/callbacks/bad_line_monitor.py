"""Bad input lines as a training metric, so a broken log feed shows in TensorBoard."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class BadLineMonitor(Callback):
    """Logs ``data/bad_lines``: lines skipped so far in the epoch's training data, and
    ``data/unreadable_files``: files of the epoch cut short under ``bad_files="skip"``.

    Works with any DataModule that has a ``bad_line_counts`` mapping (file -> count),
    and ``unreadable_files`` (file -> first record not read) where it has one, as
    ctr-lightning's log DataModules do.

    Example::

        Trainer(callbacks=[BadLineMonitor()])
    """

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        counts = getattr(trainer.datamodule, "bad_line_counts", None)
        if counts is not None:
            pl_module.log("data/bad_lines", float(sum(counts.values())), on_step=True, on_epoch=False,
                          batch_size=1)
        unreadable = getattr(trainer.datamodule, "unreadable_files", None)
        if unreadable is not None:
            pl_module.log("data/unreadable_files", float(len(unreadable)), on_step=True, on_epoch=False,
                          batch_size=1)
