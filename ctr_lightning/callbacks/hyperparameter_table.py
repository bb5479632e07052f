"""The run's hyper-parameters in TensorBoard's HPARAMS tab, beside its validation metrics."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict, _sanitize_params
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

# The columns every CTR run is compared on; a module's other validation metrics join them.
METRICS = ("val/auc", "val/logloss", "val/calibration")


class HyperparameterTable(Callback):
    """Writes the model's and the DataModule's hyper-parameters (``data/...``) to every
    TensorBoardLogger's run as an HPARAMS entry whose metrics are the run's own
    ``val/auc``, ``val/logloss`` and ``val/calibration`` scalars (and any other ``val/``
    metric the module defines): TensorBoard's HPARAMS tab then compares runs in one table,
    each with its latest validation values. Unlike ``default_hp_metric``, it logs no
    placeholder metric. ``ctr-lightning`` adds it unless the Trainer has one.

    Example::

        Trainer(logger=TensorBoardLogger("runs", default_hp_metric=False), callbacks=[HyperparameterTable()])
    """

    @override
    @rank_zero_only
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loggers = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not loggers:
            return
        from torch.utils.tensorboard.summary import hparams

        params: dict[str, Any] = dict(pl_module.hparams)
        if trainer.datamodule is not None:
            params.update({f"data/{k}": v for k, v in dict(getattr(trainer.datamodule, "hparams", {})).items()})
        params = _sanitize_params(_flatten_dict(_convert_params(params)))
        # TensorBoard's table takes numbers, strings and booleans; anything else goes as text.
        params = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()
                  if not k.startswith("_")}
        names = list(METRICS) + sorted(f"val/{k}" for k in getattr(pl_module, "val_metrics", {})
                                       if f"val/{k}" not in METRICS)
        # The values are read from the run's own scalars of these names: none is written here.
        experiment, start, end = hparams(params, {name: 0.0 for name in names})
        for logger in loggers:
            writer = logger.experiment._get_file_writer()
            for summary in (experiment, start, end):
                writer.add_summary(summary)
