"""Dense building blocks the CTR models share: MLP, numeric-feature embedding, linear
(first-order) term and factorization-machine interaction, shaped as FuxiCTR builds them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (and optional batch norm and dropout after each
    hidden layer); ``output_dim`` adds a last linear layer without activation.

    Example::

        MLP(429, [400, 400, 400], output_dim=1)(x)   # [B, 1]
    """

    def __init__(self, in_features: int, hidden: Sequence[int], output_dim: int | None = None,
                 dropout: float = 0.0, batch_norm: bool = False) -> None:
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if any(h < 1 for h in hidden):
            raise ValueError(f"hidden layer sizes must be >= 1, got {list(hidden)}")
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers.append(nn.Linear(width, size))
            if batch_norm:
                layers.append(nn.BatchNorm1d(size))
            layers.append(nn.ReLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = size
        if output_dim is not None:
            layers.append(nn.Linear(width, output_dim))
            width = output_dim
        super().__init__(*layers)
        self.out_features = width


class DenseEmbedding(nn.Module):
    """One learned vector per continuous feature, scaled by the feature's value: the
    continuous features then take part in interactions like the categorical ones
    (FuxiCTR's numeric feature embedding). ``[B, N]`` -> ``[B, N, dim]``.

    Example::

        DenseEmbedding(13, 16)(batch.dense)   # [B, 13, 16]
    """

    def __init__(self, num_features: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_features, dim))
        nn.init.normal_(self.weight, std=1e-2)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return dense.unsqueeze(-1) * self.weight


DENSE_FEATURES = ("vectors", "raw")


class FeatureInputs(nn.Module):
    """What a model's interaction and deep parts read, from the continuous features
    ``[B, N]`` and the categorical features' vectors ``[B, F, dim]``: the vectors that
    interact, and the deep part's flat input (:attr:`width` wide).

    ``dense_features="vectors"`` (FuxiCTR's way): each continuous feature becomes a learned
    vector times its value, interacts like the categorical ones and enters the deep part
    as a vector. ``"raw"`` (DeepCTR's and torchrec's DCN way): only the categorical vectors
    interact; the values are concatenated to the deep input as they are.

    Example::

        inputs = FeatureInputs(13, 26, 16, "vectors")
        vectors, flat = inputs(batch.dense, sparse_vectors)   # [B, 39, 16], [B, 624]
    """

    def __init__(self, num_dense_features: int, num_sparse_features: int, dim: int,
                 dense_features: str = "vectors") -> None:
        super().__init__()
        if dense_features not in DENSE_FEATURES:
            raise ValueError(f"dense_features must be one of {DENSE_FEATURES}, got {dense_features!r}")
        self.dense_features = dense_features
        if dense_features == "vectors":
            self.dense_embedding = DenseEmbedding(num_dense_features, dim)
            self.width = (num_dense_features + num_sparse_features) * dim
        else:
            self.width = num_dense_features + num_sparse_features * dim

    def forward(self, dense: torch.Tensor, sparse_vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dense_features == "vectors":
            vectors = torch.cat([self.dense_embedding(dense), sparse_vectors], dim=1)
            return vectors, vectors.flatten(1)
        return sparse_vectors, torch.cat([dense, sparse_vectors.flatten(1)], dim=1)


class LinearTerm(nn.Module):
    """The first-order term of a logistic regression over all features: a bias, one weight
    per continuous feature, and the sparse features' own weights (pooled per example,
    looked up with their embeddings; see :attr:`CTRModule.first_order`). ``[B]``.

    Example::

        LinearTerm(13)(batch.dense, sparse_weights)   # [B]
    """

    def __init__(self, num_dense_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(num_dense_features, 1, bias=False) if num_dense_features else None
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, dense: torch.Tensor, sparse_weights: torch.Tensor) -> torch.Tensor:
        out = sparse_weights + self.bias
        if self.dense is not None:
            out = out + self.dense(dense).squeeze(-1)
        return out


def fm_interaction(vectors: torch.Tensor) -> torch.Tensor:
    """Sum of the inner products of every pair of feature vectors, in O(F * dim)
    (Rendle, 2010): ``[B, F, dim]`` -> ``[B]``.

    Example::

        fm_interaction(torch.ones(2, 3, 4))   # tensor([12., 12.]): 3 pairs x 4
    """
    square_of_sum = vectors.sum(dim=1).pow(2)
    sum_of_squares = vectors.pow(2).sum(dim=1)
    return 0.5 * (square_of_sum - sum_of_squares).sum(dim=-1)
