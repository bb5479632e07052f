"""DCN-v2: a cross network of explicit feature crosses beside (or under) a deep MLP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet

from ctr_lightning.batch import Batch
from ctr_lightning.models.ctr_module import CTRModule
from ctr_lightning.models.layers import MLP, FeatureInputs

STRUCTURES = ("parallel", "stacked", "crossnet_only")


class DCNv2Module(CTRModule):
    """DCN-v2 (Wang et al., 2021): every feature as a vector (categorical ones from the
    tables, continuous ones as a learned vector times the value, or their raw values),
    concatenated into ``x0``; cross layers ``x_{l+1} = x0 * (W x_l + b) + x_l`` (torchrec's ``CrossNet``, or
    ``LowRankCrossNet`` with ``W = U V`` when ``low_rank`` is set), and a deep MLP either
    beside the cross network (``"parallel"``: both outputs concatenated), on top of it
    (``"stacked"``), or absent (``"crossnet_only"``), then one linear layer to the logit.
    The layout follows FuxiCTR's ``DCNv2``.

    Args:
        cross_layers: number of cross layers.
        low_rank: rank of the cross layers' weight (None: full rank).
        structure: ``"parallel"``, ``"stacked"`` or ``"crossnet_only"``.
        deep_layer_sizes: the deep MLP's hidden layers.
        dropout: dropout probability after each of the deep MLP's hidden layers (0: none).
        batch_norm: batch normalization in the deep MLP's hidden layers.
        dense_features: ``"vectors"`` (continuous features as learned vectors times their
            value, as FuxiCTR) or ``"raw"`` (their values concatenated to the deep input,
            as DeepCTR); see :class:`~ctr_lightning.models.layers.FeatureInputs`.
        **kwargs: the tables, their storage and optimizers, as :class:`CTRModule` takes them.

    Example::

        model = DCNv2Module(cross_layers=3, structure="stacked", deep_layer_sizes=(400, 400))
        Trainer(max_steps=100).fit(model, datamodule=CriteoDataModule(...))
    """

    def __init__(
        self,
        cross_layers: int = 3,
        low_rank: int | None = None,
        structure: str = "parallel",
        deep_layer_sizes: Sequence[int] = (256, 128),
        dropout: float = 0.0,
        batch_norm: bool = False,
        dense_features: str = "vectors",
        **kwargs: Any,
    ) -> None:
        if structure not in STRUCTURES:
            raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
        if cross_layers < 1:
            raise ValueError(f"cross_layers must be >= 1, got {cross_layers}")
        if low_rank is not None and low_rank < 1:
            raise ValueError(f"low_rank must be >= 1 or None, got {low_rank}")
        super().__init__(**kwargs)
        self.inputs = FeatureInputs(self.num_dense_features, self.num_sparse_features, self.embedding_dim,
                                    dense_features)
        width = self.inputs.width
        self.cross = (CrossNet(width, cross_layers) if low_rank is None
                      else LowRankCrossNet(width, cross_layers, low_rank))
        self.structure = structure
        self.deep: MLP | None = None
        final = width
        if structure == "stacked":
            self.deep = MLP(width, deep_layer_sizes, dropout=dropout, batch_norm=batch_norm)
            final = self.deep.out_features
        elif structure == "parallel":
            self.deep = MLP(width, deep_layer_sizes, dropout=dropout, batch_norm=batch_norm)
            final = width + self.deep.out_features
        self.out = nn.Linear(final, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        _, x0 = self.inputs(batch.dense, self.embed(batch.sparse))
        crossed = self.cross(x0)
        if self.structure == "stacked":
            top = self.deep(crossed)
        elif self.structure == "parallel":
            top = torch.cat([crossed, self.deep(x0)], dim=1)
        else:
            top = crossed
        return self.out(top).squeeze(-1)
