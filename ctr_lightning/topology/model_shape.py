"""What the planner places: a model's tables, their optimizer, a rank's batch and the dense part's size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.kernels.sparse_update import state_width
from ctr_lightning.embedding.optimizers import SparseAdam, SparseOptimizer


@dataclass(frozen=True)
class ModelShape:
    """What is placed: the tables, their optimizer, a rank's batch and the dense part's size.

    Example::

        shape = ModelShape.dlrm(tables, SparseAdam(), batch_size=4096, dense_in=13,
                                bottom=(512, 256), top=(1024, 1024, 512, 256, 1))
    """

    tables: tuple[EmbeddingBagConfig, ...]
    optimizer: SparseOptimizer = field(default_factory=SparseAdam)
    batch_size: int = 4096  # per rank
    dense_flops_per_example: float = 0.0  # forward and backward
    dense_params: int = 0
    k: int = 1  # the dense merge interval; k > 1 merges across nodes every k steps
    sparse_sync: str = "step"
    dlrm_layers: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None  # dense_in, bottom, top

    def row_bytes(self, table: EmbeddingBagConfig) -> int:
        return (table.embedding_dim + state_width(self.optimizer, table.embedding_dim)) * 4

    @staticmethod
    def dlrm(tables: Sequence[EmbeddingBagConfig], optimizer: SparseOptimizer, batch_size: int, dense_in: int,
             bottom: Sequence[int], top: Sequence[int], k: int = 1, sparse_sync: str = "step") -> ModelShape:
        """A DLRM's shape (torchrec's: bottom MLP to the embedding width, dot interaction,
        top MLP); ``bottom`` without its last layer, which is the embedding width."""
        dim = tables[0].embedding_dim
        f = sum(len(t.feature_names) for t in tables)
        widths = [dense_in, *bottom, dim]
        over = [dim + (f + 1) * f // 2, *top]
        matmuls = [(a, b) for a, b in zip(widths, widths[1:])] + [(a, b) for a, b in zip(over, over[1:])]
        params = sum(a * b + b for a, b in matmuls)
        flops = 2 * sum(a * b for a, b in matmuls) + 2 * (f + 1) ** 2 * dim / 2
        return ModelShape(tuple(tables), optimizer, batch_size, 3 * flops, params, k, sparse_sync,
                          (dense_in, tuple(bottom), tuple(top)))
