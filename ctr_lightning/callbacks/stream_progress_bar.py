"""A progress bar with totals and an ETA for epochs streamed from log files."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar


class StreamProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, with a total (and so an ETA) for streamed epochs.

    A streamed DataLoader has no length, so Lightning's bar shows ``489/?``. This one asks
    the loader for ``expected_batches()`` (a :class:`~ctr_lightning.datamodules.BatchDataLoader`
    knows it from the files' record counts) and caps it at the steps ``max_steps`` leaves.
    ``ctr-lightning`` adds it unless the config names a progress bar of its own.

    Example::

        Trainer(callbacks=[StreamProgressBar()]).fit(model, datamodule=CriteoDataModule(...))
    """

    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        total: int | float = trainer.num_training_batches
        if math.isinf(total):
            expected = _expected(trainer.train_dataloader)
            total = total if expected is None else expected
        if trainer.max_steps is not None and trainer.max_steps > 0:
            # The bar counts batches from the epoch's start (a resumed epoch from where it
            # stood); max_steps counts optimizer steps, each of accumulate_grad_batches batches.
            done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            total = min(total, done + left)
        return total

    @property
    def total_val_batches_current_dataloader(self) -> int | float:
        return self._or_expected(super().total_val_batches_current_dataloader, self.trainer.val_dataloaders)

    @property
    def total_test_batches_current_dataloader(self) -> int | float:
        return self._or_expected(super().total_test_batches_current_dataloader, self.trainer.test_dataloaders)

    @property
    def total_predict_batches_current_dataloader(self) -> int | float:
        return self._or_expected(super().total_predict_batches_current_dataloader, self.trainer.predict_dataloaders)

    def _or_expected(self, total: int | float, loaders: Any) -> int | float:
        if not math.isinf(total) or self.trainer.sanity_checking:
            return total
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[self._current_eval_dataloader_idx or 0] if loaders else None
        expected = _expected(loaders)
        return total if expected is None else expected


def _expected(loader: Any) -> int | None:
    expected = getattr(loader, "expected_batches", None)
    return int(expected()) if callable(expected) else None
