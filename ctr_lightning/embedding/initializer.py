"""Initial rows as a pure function of (seed, table, id): untouched rows cost nothing."""

from __future__ import annotations

import numpy as np

from ctr_lightning.hashing import splitmix64, uniform01


def initial_rows(seed: int, tables: np.ndarray, ids: np.ndarray, dim: int, bounds: np.ndarray) -> np.ndarray:
    """Uniform(-bound, bound) weights from a counter-based generator, float32 ``[n, dim]``.

    ``tables`` are the rows' table indices in the collection and ``bounds`` their
    per-row bounds (torchrec's default is ``sqrt(1 / num_embeddings)``).
    The value at (row, column) depends only on (seed, table, id, column), so a row is
    the same whether it is first seen in training, evaluation or after a restart.

    Example::

        initial_rows(0, np.array([0, 0]), np.array([5, 10**12]), 4, bounds=np.array([0.01, 0.01]))
    """
    base = splitmix64(splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ tables.astype(np.uint64)) ^ ids.astype(np.uint64))
    u = uniform01(base[:, None] ^ (np.arange(dim, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))[None, :])
    return ((2.0 * u - 1.0) * bounds[:, None]).astype(np.float32)
