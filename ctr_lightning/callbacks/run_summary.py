"""Tells the user where a finished run left its logs and checkpoint."""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class RunSummary(Callback):
    """At the end of ``fit``, prints the log directory, the checkpoint and the TensorBoard command.

    Example::

        Trainer(callbacks=[RunSummary()])
    """

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        lines = ["", "Run finished."]
        if trainer.log_dir:
            lines.append(f"  logs:       {os.path.abspath(trainer.log_dir)}")
        ckpt = trainer.checkpoint_callback
        path = getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")
        if path:
            lines.append(f"  checkpoint: {os.path.abspath(path)}")
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics:
            lines.append("  " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
        if trainer.loggers:
            root = trainer.loggers[0].save_dir
            if root:
                lines.append(f"  watch it:   tensorboard --logdir {os.path.abspath(root)}")
        rank_zero_info("\n".join(lines))
