"""A collision-free map from (table, 64-bit feature id) to row slots, for whole batches at once.

Open addressing with linear probing and backward-shift deletion, compiled with numba:
a batch of lookups is one call, never a Python loop over ids.
"""

from __future__ import annotations

import numba
import numpy as np

from ctr_lightning.embedding.kernels.cache_hints import hint

_EMPTY = np.int64(-1)
_AHEAD = 16  # probes hinted ahead in batch lookups
_CHUNK = 1024  # keys per parallel task
_PARALLEL_FROM = 4096  # keys from which a batch lookup runs in parallel
_MIX = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(cache=True, inline="always")
def _bucket(key: np.int64, tag: np.int64, mask: np.int64) -> np.int64:
    h = (np.uint64(key) ^ (np.uint64(tag) * np.uint64(0xD6E8FEB86659FD93))) * _MIX
    return np.int64(h >> np.uint64(20)) & mask


@numba.njit(cache=True, nogil=True, inline="always")
def _lookup_range(keys_table, tags_table, slots_table, keys, tags, out, start, stop):
    """Slots of keys[start:stop] into out, each probe's bucket hinted ahead."""
    mask = np.int64(len(keys_table) - 1)
    for i in range(start, min(stop, start + _AHEAD)):
        hint(keys_table, _bucket(keys[i], tags[i], mask))
    for i in range(start, stop):
        if i + _AHEAD < stop:
            hint(keys_table, _bucket(keys[i + _AHEAD], tags[i + _AHEAD], mask))
        b = _find(keys_table, tags_table, keys[i], tags[i], mask)
        out[i] = slots_table[b] if keys_table[b] != -1 else -1


@numba.njit(cache=True, nogil=True)
def _lookup(keys_table, tags_table, slots_table, keys, tags, out):
    _lookup_range(keys_table, tags_table, slots_table, keys, tags, out, 0, len(keys))


@numba.njit(parallel=True, cache=True, nogil=True)
def _lookup_parallel(keys_table, tags_table, slots_table, keys, tags, out):
    n = len(keys)
    for chunk in numba.prange((n + _CHUNK - 1) // _CHUNK):
        _lookup_range(keys_table, tags_table, slots_table, keys, tags, out, chunk * _CHUNK,
                      min(n, (chunk + 1) * _CHUNK))


@numba.njit(cache=True, nogil=True)
def _find(keys_table, tags_table, k, t, mask):
    b = _bucket(k, t, mask)
    while keys_table[b] != -1 and not (keys_table[b] == k and tags_table[b] == t):
        b = (b + 1) & mask
    return b


@numba.njit(cache=True, nogil=True)
def _insert(keys_table, tags_table, slots_table, keys, tags, slots) -> int:
    """Insert or overwrite; returns how many keys were new."""
    mask = np.int64(len(keys_table) - 1)
    added = 0
    for i in range(len(keys)):
        b = _find(keys_table, tags_table, keys[i], tags[i], mask)
        if keys_table[b] == -1:
            added += 1
            keys_table[b] = keys[i]
            tags_table[b] = tags[i]
        slots_table[b] = slots[i]
    return added


@numba.njit(cache=True, nogil=True)
def _remove(keys_table, tags_table, slots_table, keys, tags) -> int:
    mask = np.int64(len(keys_table) - 1)
    removed = 0
    for i in range(len(keys)):
        b = _find(keys_table, tags_table, keys[i], tags[i], mask)
        if keys_table[b] == -1:
            continue
        removed += 1
        # Backward-shift: pull later entries of the probe run into the hole.
        hole = b
        j = (b + 1) & mask
        while keys_table[j] != -1:
            home = _bucket(keys_table[j], tags_table[j], mask)
            if ((j - home) & mask) >= ((j - hole) & mask):
                keys_table[hole] = keys_table[j]
                tags_table[hole] = tags_table[j]
                slots_table[hole] = slots_table[j]
                hole = j
            j = (j + 1) & mask
        keys_table[hole] = -1
    return removed


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


class KeyIndex:
    """Maps (table, non-negative int64 id) pairs to int64 slots.

    The table is part of the key, so one index serves many tables without any id
    collision. It grows to stay at most half full. With ``parallel``, large batch lookups
    use every numba thread; leave it off for an index that a background thread reads, so
    that only one thread ever starts parallel regions. (Inside, an id is a probe's key
    and its table the key's tag.)

    Example::

        index = KeyIndex()
        index.insert(np.array([0, 3]), np.array([10**12, 7]), slots=np.array([0, 1]))
        index.lookup(np.array([3, 0]), np.array([7, 7]))   # array([ 1, -1])
    """

    def __init__(self, capacity: int = 1024, parallel: bool = False) -> None:
        size = 1 << max(4, int(2 * capacity - 1).bit_length())
        self._allocate(size)
        self._count = 0
        self._parallel = parallel

    def _allocate(self, size: int) -> None:
        # Key, tag and slot of a bucket side by side (24 bytes): a probe usually touches one
        # cache line, not three.
        entries = np.empty((size, 3), dtype=np.int64)
        entries[:, 0] = _EMPTY
        entries[:, 1] = 0
        entries[:, 2] = _EMPTY
        self._keys, self._tags, self._slots = entries[:, 0], entries[:, 1], entries[:, 2]

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return 3 * self._keys.nbytes  # key, tag and slot side by side

    def lookup(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Slot of each (table, id), -1 where absent."""
        out = np.empty(len(ids), dtype=np.int64)
        self._lookup_into(_i64(ids), _i64(tables), out)
        return out

    def _lookup_into(self, keys: np.ndarray, tags: np.ndarray, out: np.ndarray) -> None:
        if self._parallel and len(keys) > _PARALLEL_FROM:
            _lookup_parallel(self._keys, self._tags, self._slots, keys, tags, out)
        else:  # starting the threads would cost more than they save
            _lookup(self._keys, self._tags, self._slots, keys, tags, out)

    def lookup_unique(self, tables: np.ndarray, ids: np.ndarray,
                      slot_mark: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`dedup` and :meth:`lookup` at once: ``(first, inverse, slots)`` with
        ``slots`` the slot of each unique (table, id), -1 where absent.

        Present pairs are deduplicated by slot through ``slot_mark``, an integer array
        that is all -1 before the call and is left so; this costs one array access per
        id instead of a hash probe. Only for an index whose slots are distinct and all
        below ``len(slot_mark)``, as a row cache's are (not checked, for speed).
        """
        keys, tags = _i64(ids), _i64(tables)
        n = len(keys)
        found = np.empty(n, dtype=np.int64)
        self._lookup_into(keys, tags, found)
        first = np.empty(n, dtype=np.int64)
        inverse = np.empty(n, dtype=np.int64)
        slots = np.empty(n, dtype=np.int64)
        unique = _unique_by_slot(keys, tags, found, slot_mark, first, inverse, slots)
        return first[:unique], inverse, slots[:unique]

    def insert(self, tables: np.ndarray, ids: np.ndarray, slots: np.ndarray) -> None:
        keys = _i64(ids)
        if len(keys) and keys.min() < 0:
            raise ValueError(f"KeyIndex ids must be non-negative, got {int(keys.min())}")
        self._reserve(self._count + len(keys))
        self._count += _insert(self._keys, self._tags, self._slots, keys, _i64(tables), _i64(slots))

    def remove(self, tables: np.ndarray, ids: np.ndarray) -> None:
        self._count -= _remove(self._keys, self._tags, self._slots, _i64(ids), _i64(tables))

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All (tables, ids, slots), in no particular order."""
        used = self._keys != _EMPTY
        return self._tags[used].copy(), self._keys[used].copy(), self._slots[used].copy()

    def clear(self) -> None:
        self._keys.fill(_EMPTY)
        self._count = 0

    def _reserve(self, count: int) -> None:
        if 2 * count <= len(self._keys):
            return
        tags, keys, slots = self.items()
        size = len(self._keys)
        while 2 * count > size:
            size *= 2
        self._allocate(size)
        self._count = _insert(self._keys, self._tags, self._slots, keys, tags, slots)


@numba.njit(cache=True, nogil=True)
def _scratch_table(n):
    """An empty table for numbering up to ``n`` distinct keys: (keys, tags, numbers, mask)."""
    size = 16
    while size < 2 * n:
        size *= 2
    return (np.full(size, -1, dtype=np.int64), np.zeros(size, dtype=np.int64), np.empty(size, dtype=np.int64),
            np.int64(size - 1))


@numba.njit(cache=True, nogil=True, inline="always")
def _number(table_keys, table_tags, table_numbers, mask, key, tag, i, unique, first):
    """The number of (key, tag) in order of first appearance, and the count so far; a new
    key gets number ``unique`` and ``first[unique] = i``."""
    b = _find(table_keys, table_tags, key, tag, mask)
    if table_keys[b] == -1:
        table_keys[b] = key
        table_tags[b] = tag
        table_numbers[b] = unique
        first[unique] = i
        unique += 1
    return table_numbers[b], unique


@numba.njit(cache=True, nogil=True)
def _dedup(keys, tags, first, inverse) -> int:
    table_keys, table_tags, table_numbers, mask = _scratch_table(len(keys))
    unique = 0
    for i in range(len(keys)):
        inverse[i], unique = _number(table_keys, table_tags, table_numbers, mask, keys[i], tags[i], i, unique, first)
    return unique


@numba.njit(cache=True, nogil=True)
def _unique_by_slot(keys, tags, found, slot_mark, first, inverse, slots) -> int:
    n = len(keys)
    misses = 0
    for i in range(n):
        misses += found[i] < 0
    miss_keys, miss_tags, miss_numbers, mask = _scratch_table(misses)
    unique = 0
    for i in range(n):
        if i + _AHEAD < n and found[i + _AHEAD] >= 0:
            hint(slot_mark, found[i + _AHEAD])
        s = found[i]
        if s >= 0:
            u = slot_mark[s]
            if u < 0:
                u = unique
                slot_mark[s] = u
                first[u] = i
                slots[u] = s
                unique += 1
        else:
            u, counted = _number(miss_keys, miss_tags, miss_numbers, mask, keys[i], tags[i], i, unique, first)
            if counted > unique:
                slots[unique] = -1
                unique = counted
        inverse[i] = u
    for u in range(unique):
        if slots[u] >= 0:
            slot_mark[slots[u]] = -1
    return unique


def dedup(tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique (table, id) pairs in order of first appearance: ``(first_index, inverse)``.

    ``ids[first]`` are the unique ids (of ``tables[first]``) and ``ids[first][inverse] == ids``.
    """
    n = len(ids)
    first = np.empty(n, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    unique = _dedup(_i64(ids), _i64(tables), first, inverse)
    return first[:unique], inverse
