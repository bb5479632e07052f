"""Sparse embedding collections and their fused row-wise optimizers."""

from ctr_lightning.embedding.storage_config import AutoStorage, StorageConfig, plan_storage
from ctr_lightning.embedding.tiered import GatheringSsdRowsError, TieredEmbeddingBagCollection
from ctr_lightning.embedding.working_set_prefetcher import WorkingSetPrefetcher
from ctr_lightning.embedding.sharding_plan import TableSharding, plan_sharding
from ctr_lightning.embedding.optimizers import (
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseOptimizer,
    SparseSGD,
)

__all__ = [
    "AutoStorage",
    "GatheringSsdRowsError",
    "RowWiseAdagrad",
    "SparseAdagrad",
    "SparseAdam",
    "SparseOptimizer",
    "SparseSGD",
    "StorageConfig",
    "TableSharding",
    "TieredEmbeddingBagCollection",
    "WorkingSetPrefetcher",
    "plan_sharding",
    "plan_storage",
]
