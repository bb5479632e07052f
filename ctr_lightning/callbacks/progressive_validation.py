"""Test-then-train metrics of an online run: each time slice scored by the model before it trains on it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.hooks import RemovableHandle
from torchmetrics.classification import BinaryAUROC
from typing_extensions import override

from ctr_lightning.batch import Batch
from ctr_lightning.datamodules.sources import slice_event_time, slice_name
from ctr_lightning.metrics import Calibration, LogLoss


class ProgressiveValidation(Callback):
    """Progressive validation (test-then-train): the scores a training step's forward gives
    a batch, before that batch's update, are the next slice of traffic scored by the model
    of the moment. Per time slice (an epoch of an online DataModule: a file, a Hive
    partition, or a window of event time with ``slice_every``) it logs ``online/auc``,
    ``online/logloss`` and ``online/calibration``, with the slice's number as the step and
    its event time (the ``dt=``/``hour=`` partition, or the window's start) as the wall
    time, so TensorBoard's "wall" x-axis shows data time; the slice's name goes to
    ``online/slice`` as text. No data is held out and nothing is read twice: the scores come
    from the training forward itself (a forward hook on the module), whose output must be a
    batch's logits.

    Example::

        Trainer(callbacks=[ProgressiveValidation()], reload_dataloaders_every_n_epochs=1)
        CriteoDataModule(train_paths="logs/dt=*/hour=*/*.tsv", online=True)
    """

    def __init__(self) -> None:
        self._metrics = {"auc": BinaryAUROC(), "logloss": LogLoss(), "calibration": Calibration()}
        self._hook: RemovableHandle | None = None
        self._logits: torch.Tensor | None = None
        self.history: list[dict[str, Any]] = []  # per slice: its number, name, event time and metrics

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._hook = pl_module.register_forward_hook(self._keep_logits)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _keep_logits(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module.training and isinstance(output, torch.Tensor):
            self._logits = output.detach()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for metric in self._metrics.values():
            metric.reset()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        logits, self._logits = self._logits, None
        if logits is None or not isinstance(batch, Batch):
            return
        logits, labels = logits.float().cpu(), batch.labels.float().cpu()
        if logits.shape != labels.shape:
            raise ValueError(f"ProgressiveValidation: the module's forward gave {tuple(logits.shape)}, not one logit "
                             f"per example of the batch ({tuple(labels.shape)})")
        self._metrics["auc"].update(torch.sigmoid(logits), labels.long())
        self._metrics["logloss"].update(logits, labels)
        self._metrics["calibration"].update(logits, labels)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._metrics["logloss"].update_called:
            return
        values = {f"online/{name}": float(metric.compute()) for name, metric in self._metrics.items()}  # collective
        number = trainer.current_epoch
        name, event_time = self.slice_of(trainer.datamodule, number)
        self.history.append({"slice": number, "name": name, "event_time": event_time, **values})
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                for tag, value in values.items():
                    logger.experiment.add_scalar(tag, value, global_step=number, walltime=event_time)
                logger.experiment.add_text("online/slice", name, global_step=number, walltime=event_time)
            else:
                logger.log_metrics(values, step=number)

    @staticmethod
    def slice_of(datamodule: Any, number: int) -> tuple[str, float | None]:
        """The name and event time of the slice the DataModule's training loader reads: its
        ``epoch_slices["train"]`` (every LogDataModule's), else its ``epoch_files["train"]``'s
        Hive partition, else ``epoch N`` without a time."""
        named = getattr(datamodule, "epoch_slices", {}).get("train") if datamodule is not None else None
        if named is not None and named[0]:
            return named
        files = getattr(datamodule, "epoch_files", {}).get("train", []) if datamodule is not None else []
        return (slice_name(files), slice_event_time(files)) if files else (f"epoch {number}", None)
