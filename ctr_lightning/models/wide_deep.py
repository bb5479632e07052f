"""Wide & Deep: a linear model over the raw features beside a deep MLP over their vectors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ctr_lightning.batch import Batch
from ctr_lightning.models.ctr_module import CTRModule
from ctr_lightning.models.layers import MLP, FeatureInputs, LinearTerm


class WideDeepModule(CTRModule):
    """Wide & Deep (Cheng et al., 2016): logit = a logistic regression over every feature
    (the wide part) + a deep MLP over the features' vectors. A categorical feature's wide
    weight is one more column of its table row (:attr:`CTRModule.first_order`); continuous
    features enter the deep part as learned vectors times their value (or as they are,
    ``dense_features="raw"``), with a weight each in the wide part. The layout follows
    FuxiCTR's ``WideDeep``.

    Args:
        deep_layer_sizes: the deep MLP's hidden layers (its output is one logit).
        dropout: dropout probability after each of the deep MLP's hidden layers (0: none).
        batch_norm: batch normalization in the deep MLP's hidden layers.
        dense_features: ``"vectors"`` (continuous features as learned vectors times their
            value, as FuxiCTR) or ``"raw"`` (their values concatenated to the deep input,
            as DeepCTR); see :class:`~ctr_lightning.models.layers.FeatureInputs`.
        **kwargs: the tables, their storage and optimizers, as :class:`CTRModule` takes them.

    Example::

        model = WideDeepModule(embedding_dim=16, deep_layer_sizes=(400, 400, 400))
        Trainer(max_steps=100).fit(model, datamodule=CriteoDataModule(...))
    """

    first_order = True

    def __init__(
        self,
        deep_layer_sizes: Sequence[int] = (256, 128),
        dropout: float = 0.0,
        batch_norm: bool = False,
        dense_features: str = "vectors",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.inputs = FeatureInputs(self.num_dense_features, self.num_sparse_features, self.embedding_dim,
                                    dense_features)
        self.wide = LinearTerm(self.num_dense_features)
        self.deep = MLP(self.inputs.width, deep_layer_sizes, output_dim=1, dropout=dropout, batch_norm=batch_norm)

    def forward(self, batch: Batch) -> torch.Tensor:
        sparse_vectors, sparse_weights = self.embed_with_weights(batch.sparse)
        vectors, flat = self.inputs(batch.dense, sparse_vectors)
        logits = self.wide(batch.dense, sparse_weights) + self.deep(flat).squeeze(-1)
        interaction = self.interaction(vectors)
        return logits if interaction is None else logits + interaction

    def interaction(self, vectors: torch.Tensor) -> torch.Tensor | None:
        """A third term of the logit from the interacting vectors ``[B, F, dim]``: none in
        Wide & Deep; DeepFM's factorization machine."""
        return None
