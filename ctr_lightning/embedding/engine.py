"""What every engine behind a :class:`TieredEmbeddingBagCollection` does.

The collection keeps torchrec's interface (KJT in, KeyedTensor out) and validates its
arguments; an engine holds the rows and does the work. There are three:
:class:`LocalTables` (one process holds every table), and, under torch.distributed,
:class:`ShardedTables` (rows live on their owners; ids and pooled embeddings travel
every step) and :class:`KStepTables` (each rank trains local copies, merged by
the owners every k steps), both in :mod:`ctr_lightning.embedding.distributed`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding.sharding_plan import TableSharding
from ctr_lightning.embedding.snapshots.table_snapshot import SnapshotManifest, SnapshotRef

TableState = dict[str, Any]  # per table: "ids" [n], "rows" [n, dim + optimizer state], "steps"


class TableEngine(ABC):
    """The rows of a collection's tables and the work on them.

    Ids are always a 1-D int64 tensor; rows come back as float32 ``[len(ids), dim]``.
    Methods marked collective must be called by every rank of the engine's process group,
    in the same order.

    Example::

        engine = LocalTables(tables, setup)
        pooled = engine.forward(kjt, train=True)     # [batch, sum of dims], config order
        engine.rows("t0", torch.tensor([3, 7]))       # current weights, no side effects
    """

    @abstractmethod
    def forward(self, features: KeyedJaggedTensor, train: bool) -> torch.Tensor:
        """Pooled embeddings ``[batch, sum of dims]`` in config feature order. With ``train``,
        backward runs the sparse optimizer on the touched rows. Collective when distributed."""

    @abstractmethod
    def skip_nonfinite_updates(self, skip: bool) -> None:
        """Whether a backward whose gradient is not finite leaves every row it would update
        as it was (set while a GradScaler scales the gradients; see
        :mod:`~ctr_lightning.embedding.loss_scaling`)."""

    @abstractmethod
    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Current weights of rows of ``table``; stores nothing. Collective when distributed:
        every rank passes the same ids and gets the same rows."""

    @abstractmethod
    def export(self) -> dict[str, TableState]:
        """Every stored row, per table name. Collective when distributed (every rank gets all)."""

    @abstractmethod
    def load(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace every stored row by :meth:`export`'s state (from any number of ranks)."""

    @abstractmethod
    def save_snapshot(self, directory: str | os.PathLike, parent: SnapshotRef | None = None) -> SnapshotManifest:
        """Stream every stored row into a new table snapshot (see
        :mod:`~ctr_lightning.embedding.snapshots.table_snapshot`); each rank writes the rows it owns.
        With ``parent``, the engine's last snapshot (saved or loaded), only the rows
        changed since. Collective when distributed."""

    @abstractmethod
    def load_snapshot(self, directory: str | os.PathLike) -> SnapshotManifest:
        """Replace every stored row by a snapshot's, from any number of ranks; each rank
        keeps the rows it owns. Not collective."""

    def admission_counts(self) -> dict[str, dict[str, int]]:
        """Per table that admits ids selectively, rows ``admitted`` and ``rejected`` so far
        by this rank (an owner decides for its rows)."""
        return {}

    def sightings(self) -> dict[str, np.ndarray]:
        """Per table that counts sightings for admission, its whole sketch
        (:meth:`SightingSketch.state`, every rank's partitions joined). Collective when
        distributed."""
        return {}

    def load_sightings(self, state: Mapping[str, np.ndarray]) -> None:
        """Take the sighting counters of :meth:`sightings` (from any number of ranks)."""
        if state:
            raise ValueError(f"the checkpoint holds sighting counters for tables {sorted(state)}, which count none "
                             f"here (admission off?)")

    def expiry_counts(self) -> dict[str, dict[str, int]]:
        """Per table that expires rows, this rank's ``rows`` live now and rows ``expired``
        (ttl) and ``evicted`` (max_rows) so far."""
        return {}

    def expiry_floors(self) -> dict[str, int]:
        """Per table that expires rows, its floor (see :class:`RowExpiry`). Collective when
        distributed."""
        return {}

    def load_expiry_floors(self, floors: Mapping[str, int]) -> None:
        """Take the floors of :meth:`expiry_floors`."""
        if floors:
            raise ValueError(f"the checkpoint holds expiry floors for tables {sorted(floors)}, which expire no rows "
                             f"here (expiry off?)")

    def expiry_clock(self) -> dict[str, Any]:
        """Data time, where a table's ttl counts in it (see :meth:`RowExpiry.clock_state`).
        Collective when distributed."""
        return {}

    def load_expiry_clock(self, state: Mapping[str, Any]) -> None:
        """Take the data time of :meth:`expiry_clock`."""

    def observe_labels(self, labels: Any) -> None:
        """The labels of the training batch about to run (``[B]`` numpy), for scores that count clicks."""

    def observe_event_time(self, seconds: float | None) -> None:
        """The newest event time of the training batch about to run (this rank's; the
        newest over all ranks counts). Collective when distributed and a table's ttl counts
        in data time."""

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a name they must agree on). Collective when
        distributed."""
        return value

    @abstractmethod
    def move_device_tier(self, device: torch.device) -> None:
        """Follow ``module.to(device)``: the device tier moves, the host and SSD tiers stay."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """Cumulative counters of this rank's tiers and read-ahead."""

    @abstractmethod
    def storage(self) -> dict[str, int]:
        """What this rank's tiers hold now: rows and bytes on SSD, DRAM bytes (see
        :meth:`TierStack.storage`)."""

    def comm_bytes(self) -> int:
        """Bytes this rank has sent to other ranks (0 in one process)."""
        return 0

    @property
    def sharding_plan(self) -> dict[str, TableSharding] | None:
        """Per table, how it is split over ranks; None in one process."""
        return None

    # -- working-set prefetch (driven by WorkingSetPrefetcher) -----------------------------

    @abstractmethod
    def register_upcoming(self, features: KeyedJaggedTensor, batch: int) -> list[Callable[[], None]]:
        """Note the rows of upcoming ``batch`` and return the SSD reads that bring them in,
        for a background thread. Collective when distributed. Raises NotImplementedError
        where the engine cannot read ahead."""

    @abstractmethod
    def release_upcoming(self, batch: int) -> None:
        """``batch`` has run: forget what was read ahead for it."""

    @abstractmethod
    def stop_prefetch(self) -> None:
        """Back to fetching on demand only."""
