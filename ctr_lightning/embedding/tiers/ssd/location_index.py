"""Where each row of the SSD log lies, in 8 bytes an entry: at most 16 bytes a stored row.

An entry is a 64-bit word: the key's 32-bit hash (high half) and its record number plus
one (low half; 0 marks an empty bucket). Keys themselves are not kept: they live in the
records' headers on disk. So a hash may stand for more than one key; a reader checks the
header of the record it reads, and a writer names the record a row came from (it is known:
a row in memory remembers where it was read from), so no write ever takes another key's
entry. Robin Hood open addressing, in 256 shards by the hash's top 8 bits, each of any size
(``(low 24 bits * size) >> 24``) and grown by a quarter when its own load limit (from 72% to
86%, shard by shard) is passed: between 9.3 and 13.9 bytes an entry, and a growth rehashes
one shard, never the whole index, so no write of the SSD log waits long on it.
"""

from __future__ import annotations

import time

import numba
import numpy as np
from numba.typed import List

from ctr_lightning.embedding.kernels.cache_hints import hint
from ctr_lightning.hashing import splitmix64_one

# The index is cut into shards by the hash's top 8 bits; each grows by itself, at its own
# load between _LOAD_LOW and _LOAD_HIGH, so the shards grow at different times and one
# growth rehashes 1/256 of the entries: no write waits on a rehash of the whole index.
_SHARDS = 256
_LOAD_LOW, _LOAD_HIGH = 0.72, 0.86
_GROWTH = 1.25
_LOW = np.uint64(0xFFFFFFFF)
_IN_SHARD = np.uint64(0xFFFFFF)
_AHEAD = 16
MAX_RECORDS = (1 << 32) - 2  # record numbers fit the low half of an entry, 0 aside


@numba.njit(cache=True, nogil=True, inline="always")
def key_hash(table, row_id) -> np.uint64:
    """32 bits of a (table, id) key, the same for every process and run."""
    return splitmix64_one(np.uint64(row_id) ^ (np.uint64(table) * np.uint64(0xD6E8FEB86659FD93))) >> np.uint64(32)


@numba.njit(cache=True, nogil=True, inline="always")
def _shard(h):
    return np.int64(h >> np.uint64(24))


@numba.njit(cache=True, nogil=True, inline="always")
def _home(h, size):
    return np.int64(((h & _IN_SHARD) * np.uint64(size)) >> np.uint64(24))


@numba.njit(cache=True, nogil=True, inline="always")
def _distance(pos, home, size):
    """How far ``pos`` is past ``home`` around a shard of ``size``: a compare, where a
    modulo (Python's, for a signed difference) costs a division on every probe."""
    d = pos - home
    return d + size if d < 0 else d


@numba.njit(cache=True, nogil=True)
def _insert_entry(entries, h, record_plus_one) -> int:
    """Robin Hood insert of a new entry into its shard; returns its probe distance."""
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
        cur_dist = _distance(pos, _home(cur >> np.uint64(32), size), size)
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
    """Position of the entry of hash ``h`` in its shard: the one for ``record_plus_one`` if
    it is not 0, else the first after probe position ``start_after`` (-1: the first); -1 if none."""
    size = len(entries)
    pos = _home(h, size)
    dist = 0
    while True:
        cur = entries[pos]
        if cur == 0:
            return -1
        if _distance(pos, _home(cur >> np.uint64(32), size), size) < dist:
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
def _hashes(tables, ids):
    out = np.empty(len(ids), dtype=np.uint64)
    for i in range(len(ids)):
        out[i] = key_hash(tables[i], ids[i])
    return out


@numba.njit(cache=True, nogil=True)
def _by_shard(hashes):
    """Positions of ``hashes`` grouped by shard (a counting sort, stable) and each
    shard's start: one access to each shard's array per call."""
    starts = np.zeros(_SHARDS + 1, dtype=np.int64)
    for h in hashes:
        starts[_shard(h) + 1] += 1
    for s in range(_SHARDS):
        starts[s + 1] += starts[s]
    fill = starts[:-1].copy()
    order = np.empty(len(hashes), dtype=np.int64)
    for i in range(len(hashes)):
        s = _shard(hashes[i])
        order[fill[s]] = i
        fill[s] += 1
    return order, starts


@numba.njit(cache=True, nogil=True)
def _lookup(shards, hashes, out, probe):
    order, starts = _by_shard(hashes)
    # The keys gathered in shard order, and the answers scattered back once: the loop
    # itself reads and writes in sequence (indirect reads and writes cost a third of it).
    keys = hashes[order]
    found = np.empty(len(keys), dtype=np.int64)
    probes = np.empty(len(keys), dtype=np.int64)
    n = len(keys)
    for s in range(_SHARDS):
        first, last = starts[s], starts[s + 1]
        if first == last:
            continue
        entries = shards[s]
        size = len(entries)
        # The keys past this shard's last are the next shard's: hinted there, so the hints
        # run on across the boundary.
        following = shards[_shard(keys[last])] if last < n else entries
        for k in range(first, last):
            ahead = k + _AHEAD
            if ahead < last:
                hint(entries, _home(keys[ahead], size))
            elif ahead < n and _shard(keys[ahead]) == _shard(keys[last]):
                hint(following, _home(keys[ahead], len(following)))
            pos = _find(entries, keys[k], 0, -1)
            found[k] = -1 if pos < 0 else np.int64(entries[pos] & _LOW) - 1
            probes[k] = -1 if pos < 0 else _distance(pos, _home(keys[k], size), size)
    out[order] = found
    probe[order] = probes


@numba.njit(cache=True, nogil=True)
def _next_candidate(shards, table, row_id, after):
    """The record of the next entry with the key's hash after probe distance ``after``."""
    h = key_hash(table, row_id)
    entries = shards[_shard(h)]
    pos = _find(entries, h, 0, after)
    if pos < 0:
        return -1, -1
    return np.int64(entries[pos] & _LOW) - 1, (pos - _home(h, len(entries))) % len(entries)


@numba.njit(cache=True, nogil=True)
def _put(shards, hashes, old, new, added):
    """Point each key at its new record: the entry of its old record (known exactly) is
    changed, or a new entry made where it had none (old < 0; counted per shard in
    ``added``). Returns the first key whose old record has no entry, or -1."""
    order, starts = _by_shard(hashes)
    keys, olds, news = hashes[order], old[order], new[order]
    missing = -1
    for s in range(_SHARDS):
        if starts[s] == starts[s + 1]:
            continue
        entries = shards[s]
        for k in range(starts[s], starts[s + 1]):
            h = keys[k]
            if olds[k] >= 0:
                pos = _find(entries, h, olds[k] + 1, -1)
                if pos < 0:
                    if missing < 0 or order[k] < missing:
                        missing = order[k]
                    continue
                entries[pos] = (h << np.uint64(32)) | np.uint64(news[k] + 1)
            else:
                _insert_entry(entries, h, news[k] + 1)
                added[s] += 1
    return missing


@numba.njit(cache=True, nogil=True)
def _remove(shards, hashes, records, removed):
    """Delete the entry of each key that points at ``records[i]`` (backward shift: the
    entries after it move one place home-ward, so no tombstone is left); counted per shard
    in ``removed``."""
    order, starts = _by_shard(hashes)
    for s in range(_SHARDS):
        if starts[s] == starts[s + 1]:
            continue
        entries = shards[s]
        size = len(entries)
        for k in range(starts[s], starts[s + 1]):
            i = order[k]
            pos = _find(entries, hashes[i], records[i] + 1, -1)
            if pos < 0:
                continue
            removed[s] += 1
            while True:
                after = pos + 1
                if after == size:
                    after = 0
                cur = entries[after]
                if cur == 0 or _distance(after, _home(cur >> np.uint64(32), size), size) == 0:
                    entries[pos] = 0
                    break
                entries[pos] = cur
                pos = after


@numba.njit(cache=True, nogil=True)
def _rehash(old_entries, new_entries) -> int:
    longest = 0
    for cur in old_entries:
        if cur != 0:
            longest = max(longest, _insert_entry(new_entries, cur >> np.uint64(32), np.int64(cur & _LOW)))
    return longest


@numba.njit(cache=True, nogil=True)
def _is_current(shards, hashes, records, out):
    """Whether the entry of each key points at ``records[i]`` (a record is live)."""
    order, starts = _by_shard(hashes)
    keys, wanted = hashes[order], records[order]
    live = np.empty(len(keys), dtype=np.bool_)
    for s in range(_SHARDS):
        if starts[s] == starts[s + 1]:
            continue
        entries = shards[s]
        for k in range(starts[s], starts[s + 1]):
            live[k] = _find(entries, keys[k], wanted[k] + 1, -1) >= 0
    out[order] = live


@numba.njit(cache=True, nogil=True)
def _new_per_shard(hashes, old):
    counts = np.zeros(_SHARDS, dtype=np.int64)
    for i in range(len(hashes)):
        if old[i] < 0:
            counts[_shard(hashes[i])] += 1
    return counts


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
        self._capacity = capacity
        self.clear()
        self.grow_us = 0  # time spent growing shards
        self.most_rehashed = 0  # the most entries one write's growth rehashed (a write waits on it)

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def lookup(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(records, probes)``: each key's first candidate record (-1: none) and the
        probe distance it was found at (for :meth:`next_candidate`)."""
        out = np.empty(len(ids), dtype=np.int64)
        probe = np.empty(len(ids), dtype=np.int64)
        _lookup(self.shards, _hashes(_i64(tables), _i64(ids)), out, probe)
        return out, probe

    def next_candidate(self, table: int, row_id: int, after: int) -> tuple[int, int]:
        """The next ``(record, probe)`` of a key's hash after probe distance ``after``; (-1, -1) if none."""
        record, probe = _next_candidate(self.shards, np.int64(table), np.int64(row_id), np.int64(after))
        return int(record), int(probe)

    def put(self, tables: np.ndarray, ids: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        """Point keys at new records; ``old`` names each key's current record (-1: none)."""
        if len(new) and int(new.max()) > MAX_RECORDS:
            raise OverflowError(f"record {int(new.max())} beyond the index's {MAX_RECORDS}")
        hashes, old = _hashes(_i64(tables), _i64(ids)), _i64(old)
        self._reserve(self.counts + _new_per_shard(hashes, old))
        added = np.zeros(_SHARDS, dtype=np.int64)
        missing = _put(self.shards, hashes, old, _i64(new), added)
        self.counts += added
        self.count += int(added.sum())
        if missing >= 0:
            raise RuntimeError(f"SSD log index: no entry of table {int(tables[missing])} id {int(ids[missing])} at "
                               f"record {int(old[missing])}, where the row was read from")

    def remove(self, tables: np.ndarray, ids: np.ndarray, records: np.ndarray) -> None:
        """Forget keys whose entry points at ``records`` (others are left as they are)."""
        removed = np.zeros(_SHARDS, dtype=np.int64)
        _remove(self.shards, _hashes(_i64(tables), _i64(ids)), _i64(records), removed)
        self.counts -= removed
        self.count -= int(removed.sum())

    def is_current(self, tables: np.ndarray, ids: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Which records are the ones their keys point at (the live ones)."""
        out = np.empty(len(ids), dtype=np.bool_)
        _is_current(self.shards, _hashes(_i64(tables), _i64(ids)), _i64(records), out)
        return out

    def clear(self) -> None:
        size = max(16, int(self._capacity / _SHARDS / _LOAD_LOW) + 1)
        self.shards = List([np.zeros(size, dtype=np.uint64) for _ in range(_SHARDS)])
        self.counts = np.zeros(_SHARDS, dtype=np.int64)
        self.count = 0
        self._nbytes = _SHARDS * size * 8

    def _reserve(self, counts: np.ndarray) -> None:
        """Grow each shard that ``counts`` entries would fill past its own load limit."""
        rehashed = 0
        for s in np.flatnonzero(counts > _LIMITS * self._sizes()):
            old = self.shards[s]
            size = len(old)
            while counts[s] > _LIMITS[s] * size:
                size = int(size * _GROWTH) + 1
            start = time.perf_counter()
            grown = np.zeros(size, dtype=np.uint64)
            _rehash(old, grown)
            self.shards[s] = grown
            self._nbytes += (size - len(old)) * 8
            self.grow_us += int((time.perf_counter() - start) * 1e6)
            rehashed += int(self.counts[s])
        self.most_rehashed = max(self.most_rehashed, rehashed)

    def _sizes(self) -> np.ndarray:
        return np.array([len(a) for a in self.shards], dtype=np.int64)


# Shard s grows when its load passes its own limit, spread evenly over [_LOAD_LOW, _LOAD_HIGH].
_LIMITS = _LOAD_LOW + (_LOAD_HIGH - _LOAD_LOW) * np.arange(_SHARDS) / (_SHARDS - 1)


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)
