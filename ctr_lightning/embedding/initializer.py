"""Initial rows as a pure function of (seed, table, id): untouched rows cost nothing."""

from __future__ import annotations

import hashlib

import numba
import numpy as np

from ctr_lightning.hashing import splitmix64_one as _splitmix64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(cache=True, nogil=True, inline="always")
def _fill_row(seed_key, table, row_id, bound, out):
    key = _splitmix64(_splitmix64(seed_key ^ np.uint64(table)) ^ np.uint64(row_id))
    for d in range(len(out)):
        bits = _splitmix64(key ^ (np.uint64(d) * _GOLDEN)) >> np.uint64(11)
        u = (np.float64(bits) + 0.5) / 9007199254740992.0  # (0, 1)
        out[d] = np.float32((2.0 * u - 1.0) * bound)


@numba.njit(parallel=True, cache=True, nogil=True)
def _fill(seed, tables, ids, bounds, out):
    seed_key = _splitmix64(np.uint64(seed))
    for i in numba.prange(len(ids)):
        _fill_row(seed_key, tables[i], ids[i], bounds[i], out[i])


@numba.njit(parallel=True, cache=True, nogil=True)
def _fill_slots(seed, tables, ids, bounds, storage, slots, dim):
    seed_key = _splitmix64(np.uint64(seed))
    for i in numba.prange(len(ids)):
        row = storage[slots[i]]
        _fill_row(seed_key, tables[i], ids[i], bounds[i], row[:dim])
        row[dim:] = 0.0


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


def initialize_slots(seed: int, tables: np.ndarray, ids: np.ndarray, dim: int, bounds: np.ndarray,
                     storage: np.ndarray, slots: np.ndarray) -> None:
    """Write :func:`initial_rows` straight into ``storage[slots, :dim]`` and zero the rest
    of those rows (the optimizer state): one pass over the rows, no temporary copy."""
    _fill_slots(seed & 0xFFFFFFFFFFFFFFFF, np.ascontiguousarray(tables, dtype=np.int64),
                np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(bounds, dtype=np.float64),
                storage, np.ascontiguousarray(slots, dtype=np.int64), dim)
