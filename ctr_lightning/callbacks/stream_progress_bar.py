"""A progress bar with totals and an ETA for epochs streamed from log files."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from typing_extensions import override


class StreamProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, with a total (and so an ETA) for streamed epochs.

    A streamed DataLoader has no length, so Lightning's bar shows ``489/?``. This one asks
    the loader for ``expected_batches()`` (a :class:`~ctr_lightning.datamodules.BatchDataLoader`
    knows it from the files' record counts) and caps it at the steps ``max_steps`` leaves.
    Where a :class:`StorageMonitor` stops the run at ``stop_at_ssd_bytes`` and that end is
    nearer than the batches' (its share of the way is larger), the bar counts GiB of rows
    on SSD against that target instead, so the ETA is the run's.
    ``ctr-lightning`` adds it unless the config names a progress bar of its own.

    Example::

        Trainer(callbacks=[StreamProgressBar()]).fit(model, datamodule=CriteoDataModule(...))
    """

    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        total: int | float = trainer.num_training_batches
        if math.isinf(total):
            expected = expected_batches(trainer.train_dataloader)
            total = total if expected is None else expected
        if trainer.max_steps is not None and trainer.max_steps > 0:
            # The bar counts batches from the epoch's start (a resumed epoch from where it
            # stood); max_steps counts optimizer steps, each of accumulate_grad_batches batches.
            done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            total = min(total, done + left)
        return total

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        target = _ssd_target(trainer)
        bar = self.train_progress_bar
        steps_total = self.total_train_batches
        steps_share = (batch_idx + 1) / steps_total if steps_total and not math.isinf(steps_total) else 0.0
        if target is None or target[0] / target[1] < steps_share:
            if getattr(self, "_counting_gib", False):  # the batches' end is nearer again
                self._counting_gib = False
                bar.reset(total=convert_inf(steps_total))
                bar.unit = "it"
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        stored, stop_at = target
        if not getattr(self, "_counting_gib", False):
            self._counting_gib = True
            bar.reset(total=_gib(stop_at))
            bar.unit = "GiB"
        bar.n = _gib(min(stored, stop_at))
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        target = _ssd_target(trainer)
        if getattr(self, "_counting_gib", False) and target is not None:
            # The StorageMonitor measured after the bar's last update: show where it ended.
            self.train_progress_bar.n = _gib(min(target))
            self.train_progress_bar.refresh()
        super().on_train_end(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self._counting_gib = False
        self.train_progress_bar.unit = "it"

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
        expected = expected_batches(loaders)
        return total if expected is None else expected


def expected_batches(loader: Any) -> int | None:
    """The batches a loader expects to yield (a BatchDataLoader knows), where it says."""
    expected = getattr(loader, "expected_batches", None)
    return int(expected()) if callable(expected) else None


def _gib(size: float) -> float:
    return float(f"{size / 2**30:.3g}")


def _ssd_target(trainer: pl.Trainer) -> tuple[float, float] | None:
    """``(bytes of rows on SSD now, the StorageMonitor's stop_at_ssd_bytes)`` where one stops the run."""
    from ctr_lightning.callbacks.storage_monitor import StorageMonitor

    for callback in trainer.callbacks:
        if isinstance(callback, StorageMonitor) and callback.stop_at:
            return callback.last.get("storage/ssd_live_bytes", 0.0), float(callback.stop_at)
    return None
