"""Lightning checkpoints whose tables are streamed to snapshots instead of gathered into the
``.ckpt`` file."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from ctr_lightning.embedding.tiered import TieredEmbeddingBagCollection


def snapshot_references(state_dict: dict[str, Any]) -> set[str]:
    """Snapshot directories a checkpoint's state dict refers to."""
    return {str(v["snapshot"]) for k, v in state_dict.items()
            if k.endswith("_extra_state") and isinstance(v, dict) and "snapshot" in v}


class TableSnapshots(Callback):
    """Every checkpoint of the LightningModule's :class:`TieredEmbeddingBagCollection` s
    writes their rows to a new table snapshot (streamed from every tier, at the memory of
    one chunk; see :mod:`~ctr_lightning.embedding.table_snapshot`) and the ``.ckpt`` file
    holds only its path and its manifest's SHA-256; ``fit --ckpt_path`` loads it back.

    Snapshots go to ``root``, by default ``table_snapshots`` beside the first
    ``ModelCheckpoint``'s files. At each save, and at the end of fit, snapshots that no
    ``.ckpt`` file of the ModelCheckpoint directories refers to any more (top-k rotation,
    a save killed before its manifest) are deleted; a kept checkpoint's never are.
    One process for now.

    Example::

        Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=1000, save_top_k=3), TableSnapshots()])
    """

    def __init__(self, root: str | None = None) -> None:
        self.root = Path(root) if root is not None else None
        self._collections: list[TieredEmbeddingBagCollection] = []

    def _checkpoint_dirs(self, trainer: pl.Trainer) -> list[Path]:
        return [Path(c.dirpath) for c in trainer.checkpoint_callbacks
                if isinstance(c, ModelCheckpoint) and c.dirpath is not None]

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._collections = [m for m in pl_module.modules() if isinstance(m, TieredEmbeddingBagCollection)]
        if not self._collections:
            raise ValueError(f"TableSnapshots: {type(pl_module).__name__} has no TieredEmbeddingBagCollection")
        if self.root is None:
            dirs = self._checkpoint_dirs(trainer)
            self.root = (dirs[0] if dirs else Path(trainer.default_root_dir)) / "table_snapshots"
        for collection in self._collections:
            collection.checkpoint_to_snapshots(self.root)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if trainer.is_global_zero:
            self._collect_garbage(trainer, keep=snapshot_references(checkpoint["state_dict"]))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._collect_garbage(trainer, keep=set())

    def _collect_garbage(self, trainer: pl.Trainer, keep: set[str]) -> None:
        if self.root is None or not self.root.is_dir():
            return
        for directory in self._checkpoint_dirs(trainer):
            for path in directory.glob("*.ckpt"):
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["state_dict"]
                except Exception:  # a .ckpt being written or not ours: keep everything it may name
                    return
                keep |= snapshot_references(state)
        for snapshot in self.root.iterdir():
            if snapshot.is_dir() and str(snapshot.resolve()) not in keep:
                shutil.rmtree(snapshot, ignore_errors=True)
