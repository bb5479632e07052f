"""A DLRM click-through-rate model as a LightningModule."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torchrec.models.dlrm import DLRM

from ctr_lightning.batch import Batch
from ctr_lightning.models.ctr_module import CTRModule


class DLRMModule(CTRModule):
    """DLRM (Naumov et al., 2019): bottom MLP, sparse embeddings, dot interaction, top MLP,
    as torchrec's ``DLRM`` builds it, on a :class:`CTRModule`'s tables.

    Args:
        dense_arch_layer_sizes: bottom MLP; the last size is set to ``embedding_dim``.
        over_arch_layer_sizes: top MLP; the last size must be 1.
        **kwargs: the tables, their storage and optimizers, as :class:`CTRModule` takes them.

    Example::

        model = DLRMModule(embedding_dim=16, num_embeddings=100_000)
        logits = model(batch)           # [B]
        Trainer(max_steps=100).fit(model, datamodule=CriteoDataModule(...))
    """

    def __init__(
        self,
        dense_arch_layer_sizes: Sequence[int] = (64,),
        over_arch_layer_sizes: Sequence[int] = (128, 64, 1),
        **kwargs: Any,
    ) -> None:
        if list(over_arch_layer_sizes)[-1:] != [1]:
            raise ValueError(f"over_arch_layer_sizes must end in 1 (one logit), got {list(over_arch_layer_sizes)}")
        super().__init__(**kwargs)
        with warnings.catch_warnings():
            # A log with no dense column: the bottom MLP's first layer has no inputs, so its
            # output is a learned vector (its biases) that the dot interaction pairs with
            # every feature. torch warns that initializing the empty weight does nothing.
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
            self.dlrm = DLRM(
                embedding_bag_collection=self.embeddings,
                dense_in_features=self.num_dense_features,
                dense_arch_layer_sizes=[*dense_arch_layer_sizes, self.embedding_dim],
                over_arch_layer_sizes=list(over_arch_layer_sizes),
            )

    def forward(self, batch: Batch) -> torch.Tensor:
        # torchrec's DLRM.forward, but the pooled rows are viewed as [B, F, D] where its
        # SparseArch splits them per feature and concatenates them again (a copy each way).
        embedded_dense = self.dlrm.dense_arch(batch.dense)
        embedded_sparse = self.embed(batch.sparse)
        interactions = self.dlrm.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        return self.dlrm.over_arch(interactions).squeeze(-1)
