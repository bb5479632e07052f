"""Checks every embedding collection applies to its table configs and its input KJTs."""

from __future__ import annotations

from collections.abc import Sequence

from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def check_tables(tables: Sequence[EmbeddingBagConfig], owner: str) -> list[str]:
    """Validate table configs; return their feature names in config order."""
    if not tables:
        raise ValueError(f"{owner} needs at least one table")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"{owner}: duplicate table names in {names}")
    features = [f for t in tables for f in t.feature_names]
    if len(set(features)) != len(features):
        raise ValueError(f"{owner}: a feature feeds two tables: {features}")
    return features


def align_features(
    features: KeyedJaggedTensor, order: list[str], tables: Sequence[EmbeddingBagConfig], owner: str
) -> KeyedJaggedTensor:
    """The KJT with its keys in ``order``; an error naming the tables whose features are missing."""
    if features.keys() == order:
        return features
    missing = sorted(set(order) - set(features.keys()))
    if missing:
        owners = sorted({t.name for t in tables if set(t.feature_names) & set(missing)})
        raise KeyError(f"{owner}: KJT lacks features {missing} of tables {owners}; it has {features.keys()}")
    return features.permute([features.keys().index(f) for f in order])
