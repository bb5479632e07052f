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
        total = super().total_train_batches
        if not math.isinf(total):
            return total
        expected = _expected(self.trainer.train_dataloader)
        if expected is None:
            return total
        if self.trainer.max_steps is not None and self.trainer.max_steps > 0:
            expected = min(expected, self.trainer.max_steps - self.trainer.global_step)
        return expected

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
