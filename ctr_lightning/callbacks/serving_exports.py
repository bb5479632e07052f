"""Exports for serving while a run trains: a full one now and then, small deltas between."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ctr_lightning.callbacks.tiered_collections import tiered_collections

LATEST = "LATEST"  # the file naming the newest complete export of a ServingExport directory


class ServingExport(Callback):
    """Every ``every_n_train_steps`` training steps, writes the model for serving into a new
    directory under ``dirpath`` (``step=<global step>``, as ``ctr-lightning export`` writes
    it): every ``full_every``-th one whole, the others deltas holding only the rows changed
    since the export before (and the floors that delete rows gone since, and the dense part
    each time). ``dirpath/LATEST`` names the newest complete export; a server reads it with
    :func:`ctr_lightning.serving.read_export`, which applies the chain from its base.

    Deltas need tables that record each row's last lookup step (a model with ``expiry``:
    ``Expiry()`` expires nothing; a ttl and a row cap, by recency or by score, do too); with
    ``full_every=1`` every export is whole and any model will do. The export is made from a
    checkpoint written for it into ``dirpath`` (collective under DDP; rank 0 exports) and
    deleted afterwards; with :class:`TableSnapshots`, its table snapshot goes where the
    run's snapshots go and is cleaned up with them. The chain goes on across a resume (the
    callback's state is in the run's checkpoints); a first export whose predecessor is gone
    is whole.

    Example::

        Trainer(callbacks=[ServingExport("serving/ctr", every_n_train_steps=2000, full_every=24)])
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, every_n_train_steps: int = 1000,
                 full_every: int = 10) -> None:
        if every_n_train_steps < 1:
            raise ValueError(f"ServingExport: every_n_train_steps must be >= 1, got {every_n_train_steps}")
        if full_every < 1:
            raise ValueError(f"ServingExport: full_every must be >= 1, got {full_every}")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_train_steps = every_n_train_steps
        self.full_every = full_every
        self.previous: Path | None = None  # the newest export of the chain
        self.since_full = 0  # exports written since (and with) the last full one

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.dirpath is None:
            self.dirpath = Path(trainer.log_dir or trainer.default_root_dir) / "serving"
        unstamped = sorted(t.name for c in tiered_collections(pl_module, "ServingExport")
                           for t in c.embedding_bag_configs() if t.name not in c.delta_tables)
        if self.full_every > 1 and unstamped:
            raise ValueError(f"ServingExport(full_every={self.full_every}) writes deltas, which need tables that record "
                             f"each row's last lookup step, but tables {unstamped[:5]} do not; give the model "
                             f"expiry=Expiry() (nothing expires), or set full_every=1 to write every export whole")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step % self.every_n_train_steps == 0:
            self.export(trainer)

    def export(self, trainer: pl.Trainer) -> Path:
        """Write the next export now (collective under DDP); returns its directory."""
        from ctr_lightning.serving_export import export_for_serving

        assert self.dirpath is not None
        out = self.dirpath / f"step={trainer.global_step:09d}"
        checkpoint = self.dirpath / f".export-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(checkpoint)
        full = self.previous is None or not self.previous.exists() or self.since_full >= self.full_every
        if trainer.is_global_zero:
            if out.exists():  # written before a crash, at this very step: written again, in this chain
                shutil.rmtree(out)
            try:
                export_for_serving(checkpoint, out, since=None if full else self.previous)
            finally:
                checkpoint.unlink(missing_ok=True)
            latest = self.dirpath / f".{LATEST}.partial"
            latest.write_text(out.name + "\n")
            os.replace(latest, self.dirpath / LATEST)
            rank_zero_info(f"ServingExport: {'full export' if full else 'delta'} at step {trainer.global_step} in {out}")
        trainer.strategy.barrier("ServingExport")
        self.previous = out
        self.since_full = 1 if full else self.since_full + 1
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"previous": str(self.previous) if self.previous is not None else None, "since_full": self.since_full}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous = Path(state_dict["previous"]) if state_dict.get("previous") else None
        self.since_full = int(state_dict.get("since_full", 0))
