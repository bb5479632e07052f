"""An EmbeddingBagCollection on FBGEMM's table-batched kernel with a fused optimizer."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ctr_lightning.embedding.table_checks import align_features, check_tables
from ctr_lightning.embedding.optimizers import (
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseOptimizer,
    SparseSGD,
)

_POOLING = {PoolingType.SUM: PoolingMode.SUM, PoolingType.MEAN: PoolingMode.MEAN}


def _fbgemm_optimizer(opt: SparseOptimizer, on_cuda: bool) -> tuple[EmbOptimType, dict[str, float]]:
    # Subclasses first: RowWiseAdagrad is an SparseAdagrad is an SparseSGD.
    if isinstance(opt, RowWiseAdagrad):
        return EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": opt.lr, "eps": opt.eps}
    if isinstance(opt, SparseAdagrad):
        return EmbOptimType.EXACT_ADAGRAD, {"learning_rate": opt.lr, "eps": opt.eps}
    if isinstance(opt, SparseAdam):
        if not on_cuda:
            raise ValueError(
                "FusedEmbeddingBagCollection: FBGEMM has no CPU Adam kernel; use SparseSGD, "
                "SparseAdagrad or RowWiseAdagrad on CPU"
            )
        return EmbOptimType.ADAM, {"learning_rate": opt.lr, "eps": opt.eps,
                                   "beta1": opt.betas[0], "beta2": opt.betas[1]}
    if isinstance(opt, SparseSGD):
        return EmbOptimType.EXACT_SGD, {"learning_rate": opt.lr}
    raise TypeError(f"unknown sparse optimizer config {opt!r}")


class FusedEmbeddingBagCollection(nn.Module):
    """Pooled embedding tables in one FBGEMM table-batched kernel, optimised in backward.

    A drop-in for torchrec's ``EmbeddingBagCollection`` (KJT in, KeyedTensor out),
    with two differences: ids are folded modulo each table's ``num_embeddings`` (the
    hashing trick, so 64-bit hashed ids can be fed as they are), and the table rows
    are updated by ``optimizer`` inside backward, touching only the rows in the batch.
    The dense optimizer must not be given :meth:`parameters` of this module.

    Args:
        tables: one config per table; all must share one pooling type.
        optimizer: the sparse optimizer, fused into backward.
        is_weighted: whether the KJT carries per-id weights.
        device: ``cpu`` or a CUDA device.
        seed: initial weights are uniform(-1/sqrt(rows), 1/sqrt(rows)) from this seed.

    Example::

        ebc = FusedEmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=1000,
                                       feature_names=["f0"])],
            optimizer=RowWiseAdagrad(lr=0.05))
        kt = ebc(kjt)  # KeyedTensor with key "f0", [B, 16]
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        optimizer: SparseOptimizer = RowWiseAdagrad(),
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self._feature_names = check_tables(tables, type(self).__name__)
        poolings = {t.pooling for t in tables}
        if len(poolings) != 1 or next(iter(poolings)) not in _POOLING:
            raise ValueError(
                f"FusedEmbeddingBagCollection: all tables must share SUM or MEAN pooling, got "
                + ", ".join(f"{t.name}={t.pooling.name}" for t in tables)
            )
        device = torch.device(device or "cpu")
        on_cuda = device.type == "cuda"
        self._tables = list(tables)
        self._is_weighted = is_weighted
        self._feature_table = {f: i for i, t in enumerate(tables) for f in t.feature_names}
        self._dims = [tables[self._feature_table[f]].embedding_dim for f in self._feature_names]
        self.register_buffer(
            "_feature_rows",
            torch.tensor([tables[self._feature_table[f]].num_embeddings for f in self._feature_names],
                         dtype=torch.int64, device=device),
            persistent=False,
        )
        opt_type, opt_args = _fbgemm_optimizer(optimizer, on_cuda)
        location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
        self.kernel = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(t.num_embeddings, t.embedding_dim, location, compute) for t in tables],
            feature_table_map=[self._feature_table[f] for f in self._feature_names],
            optimizer=opt_type,
            pooling_mode=_POOLING[next(iter(poolings))],
            device=device,
            **opt_args,
        )
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for table, weight in zip(self._tables, self.kernel.split_embedding_weights()):
            bound = math.sqrt(1.0 / table.num_embeddings)
            weight.copy_(torch.empty(weight.shape).uniform_(-bound, bound, generator=gen))

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._tables

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._feature_rows.device

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        features = align_features(features, self._feature_names, self._tables, type(self).__name__)
        values = features.values().long()
        if values.numel() and bool((values < 0).any()):
            bad = (values < 0).nonzero()[0, 0]
            lengths = features.length_per_key()
            feature = self._feature_names[int(torch.searchsorted(
                torch.tensor(lengths).cumsum(0), bad.cpu(), right=True))]
            raise ValueError(
                f"FusedEmbeddingBagCollection: negative id {int(values[bad])} in feature "
                f"{feature!r} (table {self._tables[self._feature_table[feature]].name!r})"
            )
        rows = torch.repeat_interleave(
            self._feature_rows, torch.tensor(features.length_per_key(), device=values.device))
        weights = features.weights_or_none() if self._is_weighted else None
        pooled = self.kernel(
            indices=torch.remainder(values, rows),
            offsets=features.offsets().long(),
            per_sample_weights=None if weights is None else weights.float(),
        )
        return KeyedTensor(keys=self._feature_names, length_per_key=self._dims, values=pooled)
