"""Training throughput in examples per second, as TensorBoard sees it."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from ctr_lightning.batch import Batch


class ExamplesPerSecond(Callback):
    """Logs ``train/examples_per_sec``, averaged over the last ``window`` steps.

    The window spans data loading, forward, backward and the optimizer, so it is the
    end-to-end rate a user waits for. The value is logged every step; the Trainer's
    ``log_every_n_steps`` decides how often it is written.

    Example::

        Trainer(callbacks=[ExamplesPerSecond(window=50)])
    """

    def __init__(self, window: int = 50) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._marks: deque[tuple[float, int]] = deque(maxlen=window + 1)
        self._examples = 0

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._marks.clear()
        self._examples = 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The first mark is taken after step one, so warm-up never enters the rate.
        size = len(batch) if isinstance(batch, Batch) else extract_batch_size(batch)  # any LightningModule's batch
        self._examples += size
        self._marks.append((time.perf_counter(), self._examples))
        if len(self._marks) < 2:
            return
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        pl_module.log("train/examples_per_sec", (n1 - n0) / max(t1 - t0, 1e-9), prog_bar=True,
                      on_step=True, on_epoch=False, batch_size=size)
