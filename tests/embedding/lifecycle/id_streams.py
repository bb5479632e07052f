"""Batches of two features for the row lifecycle's tests: a Zipf head of ids that recur and
a long tail of ids seen once, as (lengths, ids) per feature per step."""

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def zipf_stream(seed: int, steps: int, batch: int, exponent: float) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        features = []
        for _f in range(2):
            lengths = rng.integers(0, 4, batch)
            ids = (rng.zipf(exponent, int(lengths.sum())) * 7919) % (1 << 40)
            features.append((lengths, ids.astype(np.int64)))
        out.append(features)
    return out


def kjt(features: list[tuple[np.ndarray, np.ndarray]]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["f0", "f1"], values=torch.from_numpy(np.concatenate([i for _, i in features])),
                             lengths=torch.from_numpy(np.concatenate([l for l, _ in features])))


def occurrences_kept(steps, keep) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """The stream with only the occurrences ``keep(step, feature, ids)`` selects (a mask); the
    bags stay, shorter. Called step by step, in order, so ``keep`` may count what it saw."""
    out = []
    for step, features in enumerate(steps):
        kept = []
        for f, (lengths, ids) in enumerate(features):
            mask = keep(step, f, ids)
            bag = np.repeat(np.arange(len(lengths)), lengths)
            kept.append((np.bincount(bag[mask], minlength=len(lengths)), ids[mask]))
        out.append(kept)
    return out


def train(ebc, steps, times=None, labels=None) -> list[torch.Tensor]:
    """Each step's pooled output, then a backward of a fixed linear loss (so a row's
    updates depend on its own occurrences alone); returns the outputs. ``times``: each
    step's event time, ``labels`` its examples' labels, handed to the collection before
    its forward."""
    weights = torch.randn(16, generator=torch.Generator().manual_seed(1))
    outputs = []
    for k, features in enumerate(steps):
        if times is not None:
            ebc.observe_event_time(times[k])
        if labels is not None:
            ebc.observe_labels(torch.from_numpy(labels[k]))
        pooled = ebc(kjt(features)).values()
        outputs.append(pooled.detach().clone())
        (pooled @ weights).sum().backward()
    return outputs
