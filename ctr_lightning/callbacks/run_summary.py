"""Tells the user where a finished run left its logs and checkpoint."""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class RunSummary(Callback):
    """At the end of ``fit``, prints the log directory, the checkpoint, the SSD files the
    tables leave on disk (they stay, for a resume; delete them once the run is done with)
    and the TensorBoard command.

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
        for directory, size in ssd_files(pl_module):
            lines.append(f"  SSD files:  {directory} ({size / 2**30:.2f} GiB; kept for a resume, delete when done)")
        if trainer.loggers:
            root = trainer.loggers[0].save_dir
            if root:
                lines.append(f"  watch it:   tensorboard --logdir {os.path.abspath(root)}")
        rank_zero_info("\n".join(lines))


def ssd_files(pl_module: pl.LightningModule) -> list[tuple[str, int]]:
    """The SSD directories of the module's tiered tables and the bytes of the files in each."""
    from ctr_lightning.embedding.tiered import TieredEmbeddingBagCollection

    directories = sorted({os.path.abspath(d) for m in pl_module.modules() if isinstance(m, TieredEmbeddingBagCollection)
                          for d in m.ssd_directories})
    out = []
    for directory in directories:
        size = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory)
                   for name in names if os.path.isfile(os.path.join(root, name)))
        out.append((directory, size))
    return out
