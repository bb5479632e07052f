"""What a collection knows of its table snapshots: which one its state dict refers to, which
one incremental saves build on, and where checkpoints write theirs.

The snapshots themselves (files, manifests, chains) are :mod:`table_snapshot`'s; the
engine writes and reads them (:meth:`TableEngine.save_snapshot`, :meth:`TableEngine.load_snapshot`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ctr_lightning.embedding.engine import TableEngine
from ctr_lightning.embedding.snapshots.table_snapshot import (
    MANIFEST,
    SnapshotManifest,
    SnapshotRef,
    segments_linked,
    snapshot_name,
)


class CollectionSnapshots:
    """The snapshot bookkeeping of one :class:`TieredEmbeddingBagCollection`.

    It counts versions of the rows (one snapshot serves one state of them), remembers the
    snapshot the rows were last saved to or loaded from (the parent of the next incremental
    save, until ``full_every`` saves make a chain long enough), and, once
    :meth:`checkpoint_to` set a root, writes the snapshot a state dict refers to.

    Example::

        snapshots = CollectionSnapshots()
        snapshots.save(engine, "/ckpt/s0")                     # every row
        snapshots.rows_changed()                               # a training step
        snapshots.save(engine, "/ckpt/s1", incremental=True)   # the rows changed since s0
    """

    def __init__(self) -> None:
        # With a root, checkpoints hold a reference to a table snapshot, not rows.
        self.root: Path | None = None
        self.link_segments = True  # snapshots hard-link sealed SSD segments (else copy their rows)
        # Whole rows in the state dict asked for (checkpoint_to(None)): an SSD tier is then
        # neither switched to snapshots by default nor refused.
        self.whole_rows_asked = False
        self.version = 0  # counts changes of the rows: one snapshot serves one state
        self._current: tuple[int, dict[str, Any]] | None = None  # (version, the state dict's reference)
        self.written: list[Path] = []  # by this process: TableSnapshots may delete them
        # The snapshot the rows were last saved to or loaded from, how many incremental
        # snapshots its chain holds, and after how many a checkpoint saves every row again.
        self._base: SnapshotRef | None = None
        self._chain_deltas = 0
        self._full_every = 8

    def checkpoint_to(self, root: str | os.PathLike | None, full_every: int = 8, link_segments: bool = True) -> None:
        """State dicts refer to snapshots under ``root`` from now on; ``None``: they hold
        every row, asked for (see :meth:`TieredEmbeddingBagCollection.checkpoint_to_snapshots`)."""
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.root = Path(root) if root is not None else None
        self.whole_rows_asked = root is None
        self._full_every = full_every
        self.link_segments = link_segments

    def rows_changed(self) -> None:
        """The rows changed (a training step): the snapshot written before holds older ones."""
        self.version += 1

    def rows_replaced(self) -> None:
        """Every row was replaced (a load): no snapshot holds them, nor can a save build on one."""
        self.version += 1
        self._current = None
        self._base = None

    def save(self, engine: TableEngine, directory: str | os.PathLike, incremental: bool = False,
             link_segments: bool = True) -> SnapshotManifest:
        """Write the rows to a new snapshot in ``directory``: with ``incremental``, only those
        changed since the last snapshot saved or loaded, when that one lies in the same
        folder and its chain is shorter than ``full_every``. Collective when sharded."""
        parent = self._base if incremental and self._chain_deltas + 1 < self._full_every else None
        if parent is not None and (not (Path(parent.path) / MANIFEST).exists()
                                   or Path(parent.path).resolve().parent != Path(directory).resolve().parent):
            parent = None  # removed by hand, or another run's: nothing to build on here
        # Every rank must write the same kind of snapshot: rank 0's view decides (collective).
        parent = engine.from_rank0(parent)
        with segments_linked(link_segments):
            manifest = engine.save_snapshot(directory, parent)
        self._base = SnapshotRef(str(Path(directory).resolve()), manifest.sha256())
        self._chain_deltas = self._chain_deltas + 1 if parent is not None else 0
        return manifest

    def load(self, engine: TableEngine, directory: str | os.PathLike,
             reference: dict[str, Any] | None = None) -> SnapshotManifest:
        """Replace every row by a snapshot's; with ``reference`` (a checkpoint's), the state
        dict refers to it from now on."""
        # Whatever happens below, the rows are no longer those of an earlier snapshot.
        self.rows_replaced()
        manifest = engine.load_snapshot(directory)
        self._base = SnapshotRef(str(Path(directory).resolve()), manifest.sha256())
        self._chain_deltas = len(manifest.chain(directory)) - 1
        if reference is not None:
            self.refer_to(reference)
        return manifest

    def refer_to(self, reference: dict[str, Any]) -> None:
        """The state dict of the rows now refers to ``reference``'s snapshot."""
        self._current = (self.version, reference)

    def current(self) -> Path | None:
        """The snapshot the state dict refers to now, if one was written for these rows."""
        return Path(self._current[1]["snapshot"]) if self._current is not None else None

    def reference(self, built: Callable[[], TableEngine]) -> dict[str, Any]:
        """What a state dict holds under a root: a reference to a snapshot of the rows as they
        are, written now unless one was (Lightning asks twice per checkpoint: the module is
        reachable under two names). ``built`` gives the engine, asked only to write one."""
        if self._current is None or self._current[0] != self.version:
            engine = built()
            # Collective when sharded: every rank writes into the directory rank 0 names.
            directory = self.root / engine.from_rank0(snapshot_name(self.version))
            self.written.append(directory.resolve())
            manifest = self.save(engine, directory, incremental=True, link_segments=self.link_segments)
            self._current = (self.version, {"snapshot": str(directory.resolve()),
                                            "manifest_sha256": manifest.sha256()})
        return self._current[1]

    def to_load(self, state: Mapping[str, Any],
                search: Callable[[], list[Path]] = list) -> tuple[Path, dict[str, Any]] | None:
        """The snapshot a state dict refers to, checked against the manifest it names, and
        the reference to keep once it is loaded; None if these rows came from it already
        (the module's second name). ``search``: the directories it is looked for in by name
        first (a moved run directory), before its recorded path."""
        if (self._current is not None and self._current[0] == self.version
                and self._current[1]["manifest_sha256"] == state["manifest_sha256"]):
            return None
        path = _find(state["snapshot"], search)
        if SnapshotManifest.read(path).sha256() != state["manifest_sha256"]:
            raise ValueError(f"table snapshot {path}: its manifest is not the one the checkpoint refers to")
        return path, {"snapshot": str(path.resolve()), "manifest_sha256": state["manifest_sha256"]}


def _find(recorded: str, search: Callable[[], list[Path]]) -> Path:
    """The snapshot a checkpoint names: by its name in ``search()`` (beside the checkpoint
    being loaded: a copied run directory reads its own copy, not the original it was copied
    from), else at its recorded path (whose reading says what is missing)."""
    path = Path(recorded)
    for directory in search():
        if (directory / path.name / MANIFEST).exists():
            return directory / path.name
    return path
