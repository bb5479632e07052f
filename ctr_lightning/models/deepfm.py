"""DeepFM: a factorization machine and a deep MLP over the same feature vectors."""

from __future__ import annotations

import torch

from ctr_lightning.models.layers import fm_interaction
from ctr_lightning.models.wide_deep import WideDeepModule


class DeepFMModule(WideDeepModule):
    """DeepFM (Guo et al., 2017): logit = first-order term + pairwise FM interaction of all
    feature vectors + a deep MLP over them, the vectors shared by both parts: Wide & Deep
    with the factorization machine's term added. Continuous features take part as learned
    vectors times their value (with ``dense_features="raw"``: only in the deep input, as
    they are), and with a weight of their own in the first-order term; a categorical
    feature's first-order weight is one more column of its table row
    (:attr:`CTRModule.first_order`), so it is stored, tiered, sharded and updated with the
    row. The layout follows FuxiCTR's ``DeepFM``; arguments as :class:`WideDeepModule`.

    Example::

        model = DeepFMModule(embedding_dim=16, deep_layer_sizes=(400, 400, 400))
        Trainer(max_steps=100).fit(model, datamodule=CriteoDataModule(...))
    """

    def interaction(self, vectors: torch.Tensor) -> torch.Tensor:
        return fm_interaction(vectors)
