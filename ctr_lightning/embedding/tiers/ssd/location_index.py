"""Where each row of the SSD log lies, in 8 bytes an entry: at most 16 bytes a stored row.

An entry is a 64-bit word: the key's 32-bit hash (high half) and its record number plus
one (low half; 0 marks an empty bucket). Keys themselves are not kept: they live in the
records' headers on disk. So a hash may stand for more than one key; a reader checks the
header of the record it reads, and a writer names the record a row came from (it is known:
a row in memory remembers where it was read from), so no write ever takes another key's
entry. Robin Hood open addressing over any table size (``(hash * size) >> 32``), grown by
half when 82% full: between 9.8 and 14.6 bytes an entry.
"""

from __future__ import annotations

import time

import numba
import numpy as np

from ctr_lightning.embedding.kernels.cache_hints import hint
from ctr_lightning.hashing import splitmix64_one

_MAX_LOAD = 0.82
_GROWTH = 1.5
_LOW = np.uint64(0xFFFFFFFF)
_AHEAD = 16
MAX_RECORDS = (1 << 32) - 2  # record numbers fit the low half of an entry, 0 aside


@numba.njit(cache=True, nogil=True, inline="always")
def key_hash(table, row_id) -> np.uint64:
    """32 bits of a (table, id) key, the same for every process and run."""
    return splitmix64_one(np.uint64(row_id) ^ (np.uint64(table) * np.uint64(0xD6E8FEB86659FD93))) >> np.uint64(32)


@numba.njit(cache=True, nogil=True, inline="always")
def _home(h, size):
    return np.int64((h * np.uint64(size)) >> np.uint64(32))


@numba.njit(cache=True, nogil=True)
def _insert_entry(entries, h, record_plus_one) -> int:
    """Robin Hood insert of a new entry; returns its probe distance (to watch the tail)."""
    size = len(entries)
    word = (h << np.uint64(32)) | np.uint64(record_plus_one)
    pos = _home(h, size)
    dist = 0
    longest = 0
    while True:
        cur = entries[pos]
        if cur == 0:
            entries[pos] = word
            return max(longest, dist)
        cur_dist = (pos - _home(cur >> np.uint64(32), size)) % size
        if cur_dist < dist:  # take the place of the richer entry, carry it on
            entries[pos] = word
            word = cur
            longest = max(longest, dist)
            dist = cur_dist
        pos += 1
        if pos == size:
            pos = 0
        dist += 1


@numba.njit(cache=True, nogil=True)
def _find(entries, h, record_plus_one, start_after) -> np.int64:
    """Position of the entry of hash ``h``: the one for ``record_plus_one`` if it is not 0,
    else the first after probe position ``start_after`` (-1: the first); -1 if none."""
    size = len(entries)
    pos = _home(h, size)
    dist = 0
    while True:
        cur = entries[pos]
        if cur == 0:
            return -1
        if (pos - _home(cur >> np.uint64(32), size)) % size < dist:
            return -1  # Robin Hood: a key this far from home would have been placed before
        if cur >> np.uint64(32) == h:
            if record_plus_one != 0:
                if cur & _LOW == np.uint64(record_plus_one):
                    return pos
            elif dist > start_after:
                return pos
        pos += 1
        if pos == size:
            pos = 0
        dist += 1


@numba.njit(cache=True, nogil=True)
def _lookup(entries, tables, ids, out, probe):
    size = len(entries)
    for i in range(len(ids)):
        if i + _AHEAD < len(ids):
            hint(entries, _home(key_hash(tables[i + _AHEAD], ids[i + _AHEAD]), size))
        h = key_hash(tables[i], ids[i])
        pos = _find(entries, h, 0, -1)
        out[i] = -1 if pos < 0 else np.int64(entries[pos] & _LOW) - 1
        probe[i] = -1 if pos < 0 else (pos - _home(h, size)) % size


@numba.njit(cache=True, nogil=True)
def _next_candidate(entries, table, row_id, after):
    """The record of the next entry with the key's hash after probe distance ``after``."""
    size = len(entries)
    h = key_hash(table, row_id)
    pos = _find(entries, h, 0, after)
    if pos < 0:
        return -1, -1
    return np.int64(entries[pos] & _LOW) - 1, (pos - _home(h, size)) % size


@numba.njit(cache=True, nogil=True)
def _put(entries, tables, ids, old, new) -> tuple[int, int]:
    """Point each key at its new record: the entry of its old record (known exactly) is
    changed, or a new entry made where it had none (old < 0). Returns (entries added, the
    first key whose old record has no entry, or -1)."""
    added = 0
    for i in range(len(ids)):
        h = key_hash(tables[i], ids[i])
        if old[i] >= 0:
            pos = _find(entries, h, old[i] + 1, -1)
            if pos < 0:
                return added, i
            entries[pos] = (h << np.uint64(32)) | np.uint64(new[i] + 1)
        else:
            _insert_entry(entries, h, new[i] + 1)
            added += 1
    return added, -1


@numba.njit(cache=True, nogil=True)
def _rehash(old_entries, new_entries) -> int:
    longest = 0
    for cur in old_entries:
        if cur != 0:
            longest = max(longest, _insert_entry(new_entries, cur >> np.uint64(32), np.int64(cur & _LOW)))
    return longest


@numba.njit(cache=True, nogil=True)
def _is_current(entries, tables, ids, records, out):
    """Whether the entry of each key points at ``records[i]`` (a record is live)."""
    for i in range(len(ids)):
        out[i] = _find(entries, key_hash(tables[i], ids[i]), records[i] + 1, -1) >= 0


class LocationIndex:
    """(table, id) -> record number of the SSD log, in 8 bytes an entry (see the module).

    A lookup returns a candidate record; when its header names another key (two keys
    share a 32-bit hash), :meth:`next_candidate` gives the next one. A write names each
    key's old record (-1 when the key had none), so the entry it updates is exact.

    Example::

        index = LocationIndex()
        index.put(tables, ids, old=np.full(n, -1), new=records)
        records, _ = index.lookup(tables, ids)     # -1 where absent
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.entries = np.zeros(max(16, int(capacity / _MAX_LOAD) + 1), dtype=np.uint64)
        self.count = 0
        self.grow_us = 0  # time spent growing the table

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def lookup(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(records, probes)``: each key's first candidate record (-1: none) and the
        probe distance it was found at (for :meth:`next_candidate`)."""
        out = np.empty(len(ids), dtype=np.int64)
        probe = np.empty(len(ids), dtype=np.int64)
        _lookup(self.entries, _i64(tables), _i64(ids), out, probe)
        return out, probe

    def next_candidate(self, table: int, row_id: int, after: int) -> tuple[int, int]:
        """The next ``(record, probe)`` of a key's hash after probe distance ``after``; (-1, -1) if none."""
        record, probe = _next_candidate(self.entries, np.int64(table), np.int64(row_id), np.int64(after))
        return int(record), int(probe)

    def put(self, tables: np.ndarray, ids: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        """Point keys at new records; ``old`` names each key's current record (-1: none)."""
        if len(new) and int(new.max()) > MAX_RECORDS:
            raise OverflowError(f"record {int(new.max())} beyond the index's {MAX_RECORDS}")
        self._reserve(self.count + int((old < 0).sum()))
        added, missing = _put(self.entries, _i64(tables), _i64(ids), _i64(old), _i64(new))
        self.count += added
        if missing >= 0:
            raise RuntimeError(f"SSD log index: no entry of table {int(tables[missing])} id {int(ids[missing])} at "
                               f"record {int(old[missing])}, where the row was read from")

    def is_current(self, tables: np.ndarray, ids: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Which records are the ones their keys point at (the live ones)."""
        out = np.empty(len(ids), dtype=np.bool_)
        _is_current(self.entries, _i64(tables), _i64(ids), _i64(records), out)
        return out

    def clear(self) -> None:
        self.entries = np.zeros(16, dtype=np.uint64)
        self.count = 0

    def _reserve(self, count: int) -> None:
        if count <= _MAX_LOAD * len(self.entries):
            return
        size = len(self.entries)
        while count > _MAX_LOAD * size:
            size = int(size * _GROWTH) + 1
        start = time.perf_counter()
        grown = np.zeros(size, dtype=np.uint64)
        _rehash(self.entries, grown)
        self.entries = grown
        self.grow_us += int((time.perf_counter() - start) * 1e6)


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)
