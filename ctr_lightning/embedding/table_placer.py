"""What ``storage="auto"`` needs from a planner: the interface a placer implements.

The collection plans nothing itself: it is handed a placer (``ctr_lightning.topology.place_tables``
is the one this project ships; the ``AutoPlacement`` callback hands it in under Lightning).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.optimizers import SparseOptimizer
from ctr_lightning.embedding.sharding_plan import TableSharding
from ctr_lightning.embedding.storage_config import AutoStorage, StorageConfig


class PlacedTables(Protocol):
    """A placer's answer for this rank: per table its tiers and how it is split over the ranks."""

    @property
    def storage(self) -> Mapping[str, StorageConfig]: ...

    @property
    def sharding_plan(self) -> Mapping[str, TableSharding]: ...


class TablePlacer(Protocol):
    """Plans this rank's tiers of ``tables`` and their sharding over ``process_group`` (None:
    one process). Collective when the group has more than one rank. ``sharding`` is the
    collection's request (``"auto"`` tables are the placer's choice), ``auto`` its
    :class:`AutoStorage`, ``batch_size`` the examples per step and rank, ``access`` the
    measured access profiles per table (None: the placer guesses), ``sparse_sync`` and ``k``
    how the collection syncs its rows.

    Example::

        from ctr_lightning.topology import place_tables   # a TablePlacer
        ebc = TieredEmbeddingBagCollection(tables, storage="auto", placer=place_tables)
    """

    def __call__(self, tables: Sequence[EmbeddingBagConfig], *, optimizer: SparseOptimizer,
                 sharding: str | Mapping[str, str], auto: AutoStorage, device: torch.device,
                 process_group: dist.ProcessGroup | None, batch_size: int, access: Mapping[str, Any] | None,
                 sparse_sync: str, k: int) -> PlacedTables: ...
