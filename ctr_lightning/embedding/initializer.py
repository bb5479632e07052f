"""Initial rows as a pure function of (seed, table, id): untouched rows cost nothing."""

from __future__ import annotations

import functools
import hashlib
import math

import numba
import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.hashing import splitmix64_one as _splitmix64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(cache=True, nogil=True, inline="always")
def _fill_row(seed_key, table, row_id, bound, center, out):
    key = _splitmix64(_splitmix64(seed_key ^ np.uint64(table)) ^ np.uint64(row_id))
    for d in range(len(out)):
        bits = _splitmix64(key ^ (np.uint64(d) * _GOLDEN)) >> np.uint64(11)
        u = (np.float64(bits) + 0.5) / 9007199254740992.0  # (0, 1)
        # center 0 (torchrec's default range) adds nothing: the rows of earlier versions, bit for bit.
        out[d] = np.float32((2.0 * u - 1.0) * bound + center)


@numba.njit(parallel=True, cache=True, nogil=True)
def _fill(seed, tables, ids, bounds, centers, out):
    seed_key = _splitmix64(np.uint64(seed))
    for i in numba.prange(len(ids)):
        _fill_row(seed_key, tables[i], ids[i], bounds[i], centers[i], out[i])


@numba.njit(parallel=True, cache=True, nogil=True)
def _fill_slots(seed, tables, ids, bounds, centers, storage, slots, dim):
    seed_key = _splitmix64(np.uint64(seed))
    for i in numba.prange(len(ids)):
        row = storage[slots[i]]
        _fill_row(seed_key, tables[i], ids[i], bounds[i], centers[i], row[:dim])
        row[dim:] = 0.0


def init_range(table: EmbeddingBagConfig) -> tuple[float, float]:
    """``(low, high)``: the uniform range ``table``'s rows start in, as torchrec initialises them.

    torchrec's ``EmbeddingBagCollection`` applies the config's ``init_fn``, which the config
    makes ``functools.partial(torch.nn.init.uniform_, a=weight_init_min, b=weight_init_max)``
    (``-+sqrt(1 / num_embeddings)`` where unset), so a uniform ``init_fn`` wins over the two
    settings, there as here. Any other ``init_fn`` is refused: a row here is computed from
    (seed, table, id) when it is first used, never by a function over a whole weight tensor.

    Example::

        init_range(EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100,
                                      weight_init_min=-0.5, weight_init_max=0.25))   # (-0.5, 0.25)
    """
    fn = table.init_fn
    if fn is None:  # set to None after the config was made: its own settings say the range
        low, high = table.get_weight_init_min(), table.get_weight_init_max()
    elif (isinstance(fn, functools.partial) and fn.func is torch.nn.init.uniform_ and not fn.args
          and set(fn.keywords) <= {"a", "b"}):
        # uniform_'s own defaults where the partial leaves one out
        low, high = float(fn.keywords.get("a", 0.0)), float(fn.keywords.get("b", 1.0))
    else:
        raise ValueError(
            f"table {table.name!r}: init_fn={fn!r} is not supported: rows start from a counter-based uniform "
            f"generator of (seed, table, id), computed when a row is first used, never by a function over a whole "
            f"weight tensor. Supported: EmbeddingBagConfig's weight_init_min / weight_init_max (a uniform range; "
            f"default -+sqrt(1 / num_embeddings)), or init_fn=functools.partial(torch.nn.init.uniform_, a=..., b=...)")
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ValueError(f"table {table.name!r}: the initial range [{low}, {high}] (weight_init_min, weight_init_max) "
                         f"must be finite with min <= max")
    return float(low), float(high)


def table_key(name: str) -> int:
    """A table's seed key, from its name alone: a table starts the same wherever it is
    placed (its position in a collection, or the rank that owns its shard)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def range_bounds(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(bounds, centers)`` of uniform ranges ``[low, high]``, as :func:`initial_rows` takes them."""
    low, high = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
    return (high - low) / 2, (high + low) / 2


def initial_rows(seed: int, tables: np.ndarray, ids: np.ndarray, dim: int, bounds: np.ndarray,
                 centers: np.ndarray | None = None) -> np.ndarray:
    """Uniform(center - bound, center + bound) weights from a counter-based generator,
    float32 ``[n, dim]``.

    ``tables`` are the rows' table keys (:func:`table_key`), ``bounds`` the per-row half
    widths of the range and ``centers`` its middles (default 0; :func:`range_bounds` makes
    both from :func:`init_range`'s ``[low, high]``; torchrec's default range is
    ``-+sqrt(1 / num_embeddings)``). The value at (row, column) depends only on (seed, table,
    id, column) and the range, so a row is the same whether it is first seen in training,
    in evaluation or after a restart.

    Example::

        initial_rows(0, np.full(2, table_key("t0")), np.array([5, 10**12]), 4, bounds=np.array([0.01, 0.01]))
    """
    centers = np.zeros(len(ids)) if centers is None else centers
    out = np.empty((len(ids), dim), dtype=np.float32)
    _fill(seed & 0xFFFFFFFFFFFFFFFF, np.ascontiguousarray(tables, dtype=np.int64),
          np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(bounds, dtype=np.float64),
          np.ascontiguousarray(centers, dtype=np.float64), out)
    return out


def initialize_slots(seed: int, tables: np.ndarray, ids: np.ndarray, dim: int, bounds: np.ndarray,
                     storage: np.ndarray, slots: np.ndarray, centers: np.ndarray | None = None) -> None:
    """Write :func:`initial_rows` straight into ``storage[slots, :dim]`` and zero the rest
    of those rows (the optimizer state): one pass over the rows, no temporary copy."""
    centers = np.zeros(len(ids)) if centers is None else centers
    _fill_slots(seed & 0xFFFFFFFFFFFFFFFF, np.ascontiguousarray(tables, dtype=np.int64),
                np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(bounds, dtype=np.float64),
                np.ascontiguousarray(centers, dtype=np.float64), storage, np.ascontiguousarray(slots, dtype=np.int64),
                dim)
