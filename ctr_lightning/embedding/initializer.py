"""Initial rows as a pure function of (seed, table, id): untouched rows cost nothing."""

from __future__ import annotations

import hashlib

import numba
import numpy as np

from ctr_lightning.hashing import splitmix64_one as _splitmix64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(parallel=True, cache=True, nogil=True)
def _fill(seed, tables, ids, bounds, out):
    dim = out.shape[1]
    seed_key = _splitmix64(np.uint64(seed))
    for i in numba.prange(len(ids)):
        key = _splitmix64(_splitmix64(seed_key ^ np.uint64(tables[i])) ^ np.uint64(ids[i]))
        for d in range(dim):
            bits = _splitmix64(key ^ (np.uint64(d) * _GOLDEN)) >> np.uint64(11)
            u = (np.float64(bits) + 0.5) / 9007199254740992.0  # (0, 1)
            out[i, d] = np.float32((2.0 * u - 1.0) * bounds[i])


def table_key(name: str) -> int:
    """A table's seed key, from its name alone: a table starts the same wherever it is
    placed (its position in a collection, or the rank that owns its shard)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def initial_rows(seed: int, tables: np.ndarray, ids: np.ndarray, dim: int, bounds: np.ndarray) -> np.ndarray:
    """Uniform(-bound, bound) weights from a counter-based generator, float32 ``[n, dim]``.

    ``tables`` are the rows' table keys (:func:`table_key`) and ``bounds`` their
    per-row bounds (torchrec's default is ``sqrt(1 / num_embeddings)``). The value at
    (row, column) depends only on (seed, table, id, column), so a row is the same
    whether it is first seen in training, in evaluation or after a restart.

    Example::

        initial_rows(0, np.full(2, table_key("t0")), np.array([5, 10**12]), 4, bounds=np.array([0.01, 0.01]))
    """
    out = np.empty((len(ids), dim), dtype=np.float32)
    _fill(seed & 0xFFFFFFFFFFFFFFFF, np.ascontiguousarray(tables, dtype=np.int64),
          np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(bounds, dtype=np.float64), out)
    return out
