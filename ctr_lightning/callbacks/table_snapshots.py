"""Lightning checkpoints whose tables are streamed to snapshots instead of gathered into the
``.ckpt`` file."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ctr_lightning.callbacks.tiered_collections import tiered_collections
from ctr_lightning.embedding.snapshots.table_snapshot import SNAPSHOT_NAME, SnapshotManifest, abandoned
from ctr_lightning.embedding.tiered import TieredEmbeddingBagCollection


def snapshot_references(state_dict: dict[str, Any]) -> set[str]:
    """Snapshot directories a checkpoint's state dict refers to."""
    return {str(v["snapshot"]) for k, v in state_dict.items()
            if k.endswith("_extra_state") and isinstance(v, dict) and "snapshot" in v}


def with_ancestors(snapshots: set[str]) -> set[str]:
    """The snapshots and every snapshot an incremental one among them builds on, found as
    loading finds them (:meth:`SnapshotManifest.chain`). A manifest that cannot be read, or
    an ancestor gone, raises (OSError, ValueError): the ancestors are unknown."""
    out = set()
    for path in snapshots:
        if path not in out:
            out |= {str(directory) for directory, _ in SnapshotManifest.read(path).chain(path)}
    return out


class TableSnapshots(Callback):
    """Every checkpoint of the LightningModule's :class:`TieredEmbeddingBagCollection` s
    writes their rows to a new table snapshot (streamed from every tier, at the memory of
    one chunk; see :mod:`~ctr_lightning.embedding.snapshots.table_snapshot`) and the ``.ckpt`` file
    holds only its path and its manifest's SHA-256; ``fit --ckpt_path`` loads it back.

    Snapshots go to ``root``, by default ``table_snapshots`` beside the first
    ``ModelCheckpoint``'s files. At each save, and at the end of fit, the snapshots this
    process wrote that no checkpoint file under the ModelCheckpoint directories refers to
    any more (top-k rotation) are deleted, except the one of the current rows; complete
    snapshots of earlier runs are never touched. When fit starts (a resume, typically),
    the abandoned ones under ``root`` are deleted: saves killed or failed before their
    manifest that no process writes any more (each writing rank holds a lock meanwhile),
    which nothing can load and whose hard links would keep retired SSD segments on disk.
    A checkpoint saved by hand elsewhere
    (``trainer.save_checkpoint("x.ckpt")``) does not protect its snapshot: save it into a
    ModelCheckpoint directory. A run directory moved or copied elsewhere resumes from its
    own files: a snapshot is looked for by name beside the checkpoint resumed from, and a
    chain's parents beside their child, before their recorded paths.

    Saves are incremental: a snapshot holds the rows changed since the previous one (dirty
    rows of the memory tiers, SSD records written since) and names it as its parent;
    every ``full_every``-th save holds every row again, and so does the first save of a run
    resumed from a checkpoint whose snapshots lie elsewhere (a chain never spans two
    snapshot folders). A snapshot some kept checkpoint's snapshot builds on is never deleted.

    ``link_segments``: where ``root`` is on the SSD tier's file system, a snapshot shares
    the SSD log's sealed segments by hard link (the default: a save writes little more
    than the rows in memory). Every snapshot linking a segment then holds the same bytes,
    so one damaged segment makes all of them unloadable. ``False`` copies the rows
    instead: each checkpoint is independent of the others (and of the SSD files), at the
    cost of writing and storing every row at each full save.

    A :class:`~ctr_lightning.models.CTRModule` whose tables have an SSD tier adds one by
    itself to a trainer that checkpoints (:func:`table_snapshots_by_default`).

    Under DDP with sharded tables every rank writes the rows it owns into the same
    snapshot (so the checkpoint directory must be one all ranks see, as Lightning's is),
    and rank 0 writes its manifest; a checkpoint of W ranks resumes on any number of ranks.

    Example::

        Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=1000, save_top_k=3), TableSnapshots()])
    """

    def __init__(self, root: str | None = None, full_every: int = 8, link_segments: bool = True) -> None:
        if full_every < 1:
            raise ValueError(f"TableSnapshots: full_every must be >= 1, got {full_every}")
        self.root = Path(root) if root is not None else None
        self.full_every = full_every
        self.link_segments = link_segments
        self._collections: list[TieredEmbeddingBagCollection] = []

    def _checkpoint_files(self, trainer: pl.Trainer) -> list[Path] | None:
        """Every checkpoint file under the ModelCheckpoint directories (None: there are none)."""
        callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
        if not callbacks:
            return None
        return [path for c in callbacks for path in Path(c.dirpath).rglob(f"*{c.FILE_EXTENSION}")]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before Lightning restores a checkpoint: a resumed run whose directory moved finds
        # the snapshots beside the checkpoint it resumes from (known once it is loading).
        def search() -> list[Path]:
            beside = [Path(trainer.ckpt_path).parent / "table_snapshots"] if trainer.ckpt_path else []
            return beside + ([self.root] if self.root is not None else [])

        for collection in tiered_collections(pl_module, "TableSnapshots"):
            collection.snapshot_search = search

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._collections = tiered_collections(pl_module, "TableSnapshots")
        if self.root is None:
            dirs = [c.dirpath for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
            self.root = Path(dirs[0] if dirs else trainer.default_root_dir) / "table_snapshots"
        for collection in self._collections:
            collection.checkpoint_to_snapshots(self.root, self.full_every, self.link_segments)
        if trainer.is_global_zero:
            self._delete_abandoned()

    def _delete_abandoned(self) -> None:
        # Rank 0 alone: a clean-up that cannot read the root must not stop it.
        try:
            incomplete = [d for d in self.root.iterdir() if SNAPSHOT_NAME.fullmatch(d.name) and abandoned(d)]
        except OSError:
            return
        for directory in incomplete:
            shutil.rmtree(directory, ignore_errors=True)
        if incomplete:
            rank_zero_info(f"TableSnapshots: deleted {len(incomplete)} abandoned snapshot(s) under {self.root} "
                           f"(saves killed or failed before their manifest): "
                           f"{', '.join(sorted(d.name for d in incomplete))}")

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
        files = self._checkpoint_files(trainer)
        if files is None:
            return  # no checkpoint directory to tell which snapshots are still needed
        for path in files:
            try:
                keep |= snapshot_references(torch.load(path, map_location="cpu", weights_only=True,
                                                       mmap=True)["state_dict"])
            except Exception:  # a file being written, or not ours: delete nothing this time
                return
        for collection in self._collections:
            current = collection.current_snapshot()
            if current is not None:
                keep.add(str(current))
        try:
            keep = with_ancestors(keep)
        except (OSError, ValueError):
            return  # a kept snapshot's manifest unreadable: its ancestors unknown, delete nothing this time
        for collection in self._collections:
            kept = []
            for snapshot in collection.snapshots_written:
                if str(snapshot) in keep:
                    kept.append(snapshot)
                else:
                    shutil.rmtree(snapshot, ignore_errors=True)
            collection.snapshots_written = kept


def table_snapshots_by_default(pl_module: pl.LightningModule) -> list[Callback]:
    """What a LightningModule's ``configure_callbacks`` returns so that its checkpoints
    never gather tables held on SSD into memory: ``[TableSnapshots()]`` when some
    :class:`TieredEmbeddingBagCollection` of it would (:attr:`~TieredEmbeddingBagCollection.gathers_ssd_rows`),
    its trainer checkpoints (a ``ModelCheckpoint``, say), and the trainer has no
    TableSnapshots of its own (whose settings stay); else ``[]``. Lightning adds what this
    returns to the trainer's callbacks before set-up, so a resumed run finds its snapshots.
    :class:`~ctr_lightning.models.CTRModule` does so; tables held in memory keep whole
    rows in the checkpoint.

    Example::

        class MyModel(pl.LightningModule):
            def configure_callbacks(self):
                return table_snapshots_by_default(self)
    """
    trainer = pl_module.trainer
    if not trainer.checkpoint_callbacks or any(isinstance(c, TableSnapshots) for c in trainer.callbacks):
        return []
    collections = [m for m in pl_module.modules() if isinstance(m, TieredEmbeddingBagCollection)]
    return [TableSnapshots()] if any(c.gathers_ssd_rows for c in collections) else []
