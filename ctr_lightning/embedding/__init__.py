"""Sparse embedding collections and their fused row-wise optimizers.

At this level: the collection (``tiered``), its engines (``engine``, ``local_tables``,
``table_group``), their settings and configs (``table_setup``, ``storage_config``,
``optimizers``, ``sharding_plan``, ``admission_config``, ...). Below it: ``tiers`` (device, host and SSD storage),
``snapshots`` (rows streamed to files), ``prefetch`` (the working set read ahead),
``kernels`` (pooling and the fused optimizer step), ``lifecycle`` (which rows a table keeps:
admission) and ``distributed`` (the sharded engines).
"""

from ctr_lightning.embedding.admission_config import Admission
from ctr_lightning.embedding.expiry_config import Expiry
from ctr_lightning.embedding.storage_config import AutoStorage, StorageConfig, plan_storage
from ctr_lightning.embedding.tiered import GatheringSsdRowsError, TieredEmbeddingBagCollection
from ctr_lightning.embedding.prefetch.working_set_prefetcher import WorkingSetPrefetcher
from ctr_lightning.embedding.sharding_plan import TableSharding, plan_sharding
from ctr_lightning.embedding.optimizers import (
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseOptimizer,
    SparseSGD,
)

__all__ = [
    "Admission",
    "Expiry",
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
