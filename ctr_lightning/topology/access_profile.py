"""How skewed each table's lookups are: measured from the first batches of the data, or Zipf."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class TableAccess:
    """A table's lookup distribution as blocks of ids of equal frequency, hottest first:
    ``ids[j]`` ids each drawn with probability ``probs[j]`` per lookup. ``pooling`` is the
    mean ids per example.

    Sampled profiles group the ids by their count and estimate the never-seen ids with
    Good-Turing: the share of lookups whose id was seen once is the chance that a lookup
    asks for an id the sample never saw; it is spread over the rest of the table's ids.

    Example::

        access = TableAccess.zipf(num_ids=1_000_000, exponent=1.05)
        access.coverage(100_000)       # share of lookups the 100k hottest rows serve
        access.unique(4096)            # distinct rows a batch of 4096 lookups touches
    """

    ids: np.ndarray
    probs: np.ndarray
    pooling: float = 1.0

    @staticmethod
    def zipf(num_ids: int, exponent: float, pooling: float = 1.0) -> TableAccess:
        """Zipf(``exponent``) over ``num_ids`` ids: the 1024 hottest one by one, then blocks
        1% wide, each id given the block's mean probability."""
        edges = np.unique(np.concatenate([
            np.arange(1, min(num_ids, 1024) + 1),
            np.geomspace(1025, num_ids + 1, num=max(int(np.log(max(num_ids, 1025) / 1025) / np.log(1.01)), 2))
            .astype(np.int64) if num_ids > 1024 else np.zeros(0, np.int64),
            [num_ids + 1]]).astype(np.int64))
        lo, hi = edges[:-1].astype(np.float64), edges[1:].astype(np.float64)
        if exponent == 1.0:
            mass = np.log((hi - 0.5) / (lo - 0.5))
        else:
            mass = ((hi - 0.5) ** (1 - exponent) - (lo - 0.5) ** (1 - exponent)) / (1 - exponent)
        single = hi - lo == 1
        mass[single] = lo[single] ** -exponent  # exact for the ids kept one by one
        mass /= mass.sum()
        counts = (hi - lo).astype(np.int64)
        return TableAccess(counts, mass / counts, pooling)

    @staticmethod
    def from_counts(counts: np.ndarray, num_ids: int, pooling: float = 1.0) -> TableAccess:
        """From per-id lookup counts of a sample; ``num_ids`` is how many ids the table may hold."""
        counts = np.asarray(counts)
        counts = counts[counts > 0]
        total = float(counts.sum())
        if total == 0:
            raise ValueError("a table's access sample holds no lookups")
        values, ids = np.unique(counts, return_counts=True)
        values, ids = values[::-1].astype(np.float64), ids[::-1].astype(np.int64)
        unseen_mass = float((counts == 1).sum()) / total
        unseen_ids = num_ids - len(counts)
        if unseen_ids <= 0 or unseen_mass == 0:
            return TableAccess(ids, values / total, pooling)
        probs = values / total * (1 - unseen_mass)
        return TableAccess(np.append(ids, unseen_ids), np.append(probs, unseen_mass / unseen_ids), pooling)

    @property
    def num_ids(self) -> int:
        return int(self.ids.sum())

    def coverage(self, rows: float) -> float:
        """Share of lookups that the ``rows`` hottest rows serve (an ideal LFU cache)."""
        return float((np.clip(rows - self._starts, 0, self.ids) * self.probs).sum())

    def unique(self, lookups: float, skip: float = 0) -> float:
        """Expected distinct rows among ``lookups`` independent lookups, not counting the
        ``skip`` hottest rows (those a cache of ``skip`` rows holds)."""
        if lookups <= 0:
            return 0.0
        beyond = self.ids - np.clip(skip - self._starts, 0, self.ids)
        touched = -np.expm1(lookups * np.log1p(-np.minimum(self.probs, 1 - 1e-12)))
        return float((beyond * touched).sum())

    def lru_misses(self, lookups: float, cache_rows: float) -> float:
        """Expected distinct rows among ``lookups`` that an LRU cache of ``cache_rows`` rows
        does not hold, by Che's approximation: a row stays cached for a characteristic
        time ``T`` (in lookups) after its last use, with ``T`` such that the expected rows
        used within ``T`` fill the cache."""
        if lookups <= 0:
            return 0.0
        if cache_rows >= self.num_ids:
            return 0.0
        p = np.minimum(self.probs, 1 - 1e-12)
        if cache_rows <= 0:
            return self.unique(lookups)

        def filled(t: float) -> float:
            return float((self.ids * -np.expm1(-p * t)).sum())

        lo, hi = 0.0, 1.0
        while filled(hi) < cache_rows:
            hi *= 2
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if filled(mid) < cache_rows else (lo, mid)
        touched = -np.expm1(lookups * np.log1p(-p))
        return float((self.ids * touched * np.exp(-p * hi)).sum())

    def rows_above(self, share: float) -> int:
        """How many rows serve at least ``share`` of the lookups each."""
        return int(self.ids[self.probs >= share].sum())

    @property
    def _starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.ids)[:-1]])


def measure_access(batches: Iterable, tables: Mapping[str, Sequence[str]], num_ids: Mapping[str, int],
                   max_batches: int) -> dict[str, TableAccess]:
    """Count each table's ids over the first ``max_batches`` batches (objects with a
    ``sparse`` KeyedJaggedTensor); ``tables`` maps a table to its features.

    Example::

        access = measure_access(datamodule.train_dataloader(), {"t_C1": ["C1"]}, {"t_C1": 10**8}, 50)
    """
    ids: dict[str, list[np.ndarray]] = {t: [] for t in tables}
    examples = 0
    for i, batch in enumerate(batches):
        if i >= max_batches:
            break
        features = batch.sparse.to_dict()
        examples += len(batch.labels)
        for table, names in tables.items():
            for name in names:
                if name not in features:
                    raise KeyError(f"access profile: table {table!r} reads feature {name!r}, "
                                   f"which the data does not have (it has {sorted(features)})")
                ids[table].append(features[name].values().numpy())
    if examples == 0:
        raise ValueError("access profile: the data gave no batch to count ids in")
    out = {}
    for table, parts in ids.items():
        values = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if not len(values):
            raise ValueError(f"access profile: table {table!r} got no id in the first {max_batches} batches "
                             f"({examples} examples)")
        _, counts = np.unique(values, return_counts=True)
        out[table] = TableAccess.from_counts(counts, num_ids[table], pooling=len(values) / examples)
    return out
