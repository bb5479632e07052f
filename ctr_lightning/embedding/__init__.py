"""Sparse embedding collections and their fused row-wise optimizers."""

from ctr_lightning.embedding.fused import FusedEmbeddingBagCollection
from ctr_lightning.embedding.optimizers import (
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseOptimizer,
    SparseSGD,
)

__all__ = [
    "FusedEmbeddingBagCollection",
    "RowWiseAdagrad",
    "SparseAdagrad",
    "SparseAdam",
    "SparseOptimizer",
    "SparseSGD",
]
