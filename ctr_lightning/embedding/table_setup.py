"""What every engine of a collection is built from, besides its tables."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ctr_lightning.embedding.optimizers import SparseOptimizer
from ctr_lightning.embedding.storage_config import StorageConfig


@dataclass(frozen=True)
class TableSetup:
    """How a collection's tables are stored and trained, per table where it differs.

    :class:`TieredEmbeddingBagCollection` checks its arguments and builds one of these;
    the engines (:class:`LocalTables`, :class:`ShardedTables`, :class:`ReplicatedTables`)
    take it whole, and derive the setups of their parts from it.

    Example::

        setup = TableSetup(storage={"t0": StorageConfig(ssd_dir="/nvme/run1")}, id_space={"t0": "hashed"},
                           is_weighted=False, optimizer=SparseAdam(), device=torch.device("cpu"), seed=0,
                           kernel="auto")
        LocalTables(tables, setup.for_rank(1))   # rank 1's SSD files under /nvme/run1/rank1
    """

    storage: Mapping[str, StorageConfig]
    id_space: Mapping[str, str]
    is_weighted: bool
    optimizer: SparseOptimizer
    device: torch.device
    seed: int
    kernel: str
    owner: str = "TieredEmbeddingBagCollection"  # named in error messages

    def for_rank(self, rank: int) -> TableSetup:
        """The same, with each SSD directory moved to a ``rank<r>`` subdirectory: ranks on
        one machine must not share SSD files."""
        storage = {name: s if s.ssd_dir is None
                   else dataclasses.replace(s, ssd_dir=os.path.join(s.ssd_dir, f"rank{rank}"))
                   for name, s in self.storage.items()}
        return dataclasses.replace(self, storage=storage)

    def in_memory(self) -> TableSetup:
        """The same, with every table held whole in the device tier."""
        return dataclasses.replace(self, storage={name: StorageConfig() for name in self.storage})
