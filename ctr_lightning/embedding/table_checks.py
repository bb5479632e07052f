"""Checks every embedding collection applies to its table configs and its input KJTs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def check_tables(tables: Sequence[EmbeddingBagConfig], owner: str) -> list[str]:
    """Validate table configs; return their feature names in config order.

    A table without ``feature_names`` reads the feature of its own name, written into its
    config, as torchrec's ``EmbeddingBagCollection`` does.
    """
    if not tables:
        raise ValueError(f"{owner} needs at least one table")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"{owner}: duplicate table names in {names}")
    for t in tables:
        if not t.feature_names:
            t.feature_names = [t.name]
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
    _check_present(features, order, tables, owner)
    return features.permute([features.keys().index(f) for f in order])


def torchrec_input(features: KeyedJaggedTensor, order: list[str], tables: Sequence[EmbeddingBagConfig],
                   is_weighted: bool, owner: str) -> KeyedJaggedTensor:
    """``features`` as the engines take them (one batch size for every feature), with
    torchrec's ``EmbeddingBagCollection`` as the reference for what it accepts:

    - every feature the tables read is there (a KeyError naming them, as torchrec's);
    - a weighted collection gets weights (torchrec asserts; here a ValueError), and an
      unweighted one drops any it gets (torchrec ignores them), so no engine uses them;
    - a variable-batch KJT (``stride_per_key_per_rank``) with ``inverse_indices`` is
      expanded to the batch those index, each feature's bags in their order: the pooled
      result torchrec returns, its gradients summed over the copies of a bag. Without
      ``inverse_indices`` its features must share one batch size, as torchrec needs to
      concatenate them (else a ValueError naming each feature's).

    Example::

        kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([4, 5]), lengths=torch.tensor([1, 1]),
                                stride_per_key_per_rank=[[2]], inverse_indices=(["f0"], torch.tensor([[0, 1, 1]])))
        torchrec_input(kjt, ["f0"], tables, False, "ebc").lengths()   # tensor([1, 1, 1]): bags 0, 1, 1
    """
    _check_present(features, order, tables, owner)
    if is_weighted and features.weights_or_none() is None:
        raise ValueError(f"{owner}: the collection is weighted (is_weighted=True) but the KJT of features "
                         f"{features.keys()} carries no weights; pass per-id weights (KeyedJaggedTensor(weights=...)), "
                         f"or build the collection with is_weighted=False (torchrec's EmbeddingBagCollection refuses "
                         f"such a KJT too)")
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        if features.variable_stride_per_key():
            strides = dict(zip(features.keys(), features.stride_per_key()))
            if len({strides[f] for f in order}) > 1:
                raise ValueError(f"{owner}: a variable-batch KJT without inverse_indices: the features have batch "
                                 f"sizes {({f: strides[f] for f in order})}, and pooled features of different batch "
                                 f"sizes cannot be put side by side (torchrec fails too); give the KJT the "
                                 f"inverse_indices that map the full batch to each feature's bags")
            return _expanded(features, order, None, is_weighted, owner)
        if not is_weighted and features.weights_or_none() is not None:
            return KeyedJaggedTensor(keys=features.keys(), values=features.values(), lengths=features.lengths(),
                                     stride=features.stride())
        return features
    return _expanded(features, order, inverse, is_weighted, owner)


def _check_present(features: KeyedJaggedTensor, order: list[str], tables: Sequence[EmbeddingBagConfig],
                   owner: str) -> None:
    missing = sorted(set(order) - set(features.keys()))
    if missing:
        owners = sorted({t.name for t in tables if set(t.feature_names) & set(missing)})
        raise KeyError(f"{owner}: KJT lacks features {missing} of tables {owners}; it has {features.keys()}")


def _expanded(features: KeyedJaggedTensor, order: list[str], inverse: tuple[list[str], torch.Tensor] | None,
              weighted: bool, owner: str) -> KeyedJaggedTensor:
    """A KJT of the features in ``order`` with one batch size: bag ``inverse[f][i]`` of
    feature ``f`` at batch position ``i`` (``None``: the bags as they are); its weights
    only if ``weighted``."""
    rows = {} if inverse is None else {name: i for i, name in enumerate(inverse[0])}
    unmapped = [f for f in order if inverse is not None and f not in rows]
    if unmapped:
        raise KeyError(f"{owner}: the KJT's inverse_indices have no row for features {unmapped}; they cover "
                       f"{list(inverse[0])}")
    per_feature = features.to_dict()
    values, lengths, weights = [], [], []
    for f in order:
        bags = per_feature[f]
        bag_lengths, starts = bags.lengths(), bags.offsets()[:-1]
        if inverse is not None:
            index = inverse[1][rows[f]].to(device=bag_lengths.device, dtype=torch.int64)
            bag_lengths, starts = bag_lengths[index], starts[index]
        # Position of every value of the new bags in the feature's values.
        ends = torch.cumsum(bag_lengths, 0)
        positions = (torch.arange(int(ends[-1]) if len(ends) else 0, device=bag_lengths.device)
                     + torch.repeat_interleave(starts - (ends - bag_lengths), bag_lengths))
        values.append(bags.values()[positions])
        lengths.append(bag_lengths)
        if weighted:
            weights.append(bags.weights()[positions])
    batch = len(lengths[0])
    return KeyedJaggedTensor(keys=list(order), values=torch.cat(values), lengths=torch.cat(lengths),
                             weights=torch.cat(weights) if weighted else None, stride=batch)
