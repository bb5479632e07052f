"""KStepAdamStrategy's traffic and merges, on the Trainer's loggers."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class KStepMonitor(Callback):
    """Logs what :class:`KStepAdamStrategy` records, at the step it recorded it.

    Every step: ``kstep/intra_node_bytes`` and ``kstep/inter_node_bytes`` (bytes this rank
    sent inside its node and across nodes); at merges: ``kstep/merge_ms``,
    ``kstep/divergence`` and, with ``overlap=True``, ``kstep/merge_wait_ms``. Like
    Lightning's ``LearningRateMonitor`` it writes to the loggers itself: merges also
    happen outside training steps (when validation starts, at the end of fit), where
    ``LightningModule.log`` cannot be called. The strategy adds one to the Trainer when
    none is given.

    Example::

        Trainer(strategy=KStepAdamStrategy(k=16), callbacks=[KStepMonitor()])
    """

    def _flush(self, trainer: pl.Trainer) -> None:
        records: list[tuple[int, dict[str, float]]] = getattr(trainer.strategy, "pop_metrics", list)()
        for step, metrics in records:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._flush(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)  # the merge when validation started

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)  # the merge at the end of training
