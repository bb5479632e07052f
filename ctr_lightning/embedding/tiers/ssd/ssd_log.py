"""The SSD tier of tables with hashed ids: a log of segment files, cleaned a piece at a time."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ctr_lightning.embedding.lifecycle.row_expiry import read_last_seen
from ctr_lightning.embedding.tiers.ssd.directory_lock import DirectoryLock
from ctr_lightning.embedding.tiers.ssd.location_index import LocationIndex
from ctr_lightning.embedding.tiers.ssd.record_io import transfer_records
from ctr_lightning.embedding.tiers.ssd.ssd_log_cleaner import LogCleaner, Rank
from ctr_lightning.embedding.tiers.ssd.ssd_log_segments import (BACKGROUND_READ_MIN, HEADER_WORDS, KEY, NO_RECORD, Segment,
                                                             SegmentFiles, make_records, record_keys)
from ctr_lightning.embedding.tiers.ssd.ssd_log_snapshots import LogSnapshots
from ctr_lightning.embedding.tiers.ssd.ssd_tier import Entries, Relocated, SealedSegment, claim_directory


class SsdLog:
    """Rows of tables with hashed (any 64-bit) ids, as a log of fixed-size records: an
    :class:`~ctr_lightning.embedding.tiers.ssd.ssd_tier.SsdTier`.

    A record is a header (id, table) and the row (weights and optimizer state). Writes
    append to the newest segment file, ``segment_bytes`` each, in one ``pwrite`` a run,
    and only then point the :class:`LocationIndex` at them, so a failed write leaves the
    old copies in force. A record's location (segment number and slot) names one copy of
    one row: a row rewritten or moved gets a new one. The files are a
    :class:`~ctr_lightning.embedding.tiers.ssd.ssd_log_segments.SegmentFiles`.

    Rewriting a row leaves its old record as garbage. After each write, while the files
    hold more than ``1 + max_garbage`` times the live records (beyond the segment being
    filled), the segment with the least live share is cleaned
    (:class:`~ctr_lightning.embedding.tiers.ssd.ssd_log_cleaner.LogCleaner`): its live records are
    appended anew and the file deleted, at most twice the records just written per call,
    so no step waits on a whole cleaning, and the files stay within about
    ``1 + max_garbage`` times the live rows. Moved rows are returned (:class:`Relocated`),
    so memory tiers that hold a copy keep its location current. Snapshots read and share
    its segments through :class:`~ctr_lightning.embedding.tiers.ssd.ssd_log_snapshots.LogSnapshots`.

    The index holds 8 bytes an entry (10-15 a row); keys live only in the records' headers.

    Example::

        log = SsdLog("/nvme/run1", "dim64", width=192, table_names=["t0"])
        locations, moved = log.write(tables, ids, rows, old=np.full(len(ids), -1))
        found, rows, locations = log.read(tables, ids)
    """

    shares_segments = True

    def __init__(self, directory: str | os.PathLike, name: str, width: int, table_names: list[str],
                 segment_bytes: int = 256 << 20, max_garbage: float = 0.3, stamp_column: int | None = None) -> None:
        self.directory = Path(directory)
        self.name = name
        self.width = width
        self.table_names = table_names
        self.record_words = HEADER_WORDS + width
        self.record_bytes = self.record_words * 4
        self.segment_records = max(1, segment_bytes // self.record_bytes)
        self.index = LocationIndex()
        self.files = SegmentFiles(self.directory, name, table_names, self.record_words, self.segment_records)
        # Where rows expire: each row's rank key (its last lookup step, at stamp_column, or
        # the group's RowExpiry.rank_keys: a score's bucket too), and per table the floor below
        # which rows are gone (set by the training thread; it only rises).
        self.rank: Rank | None = None if stamp_column is None else (
            lambda tables, rows: read_last_seen(rows, stamp_column))
        self.floors: np.ndarray | None = None
        self.cleaner = LogCleaner(self.files, self.index, self._append, max_garbage, lambda: self.floors,
                                  lambda tables, rows: self.rank(tables, rows))
        self._timing = {"ssd_write_us": 0, "ssd_clean_us": 0}
        # Held while the layout changes and while a prefetch thread locates rows; reading
        # located records needs no lock (their segments are pinned meanwhile).
        self.lock = threading.Lock()
        self.snapshots = LogSnapshots(self.files, self.index, self.lock)
        self._claim: DirectoryLock | None = None
        self._claim = claim_directory(self.directory, table_names)
        try:
            self.files.remove_stale()
        except OSError as e:
            raise OSError(e.errno, f"SSD tier of tables {table_names}: cannot create files in "
                                   f"{self.directory}: {e.strerror}") from e
        # Compiled now, not in the middle of the step whose evictions first reach the SSD.
        transfer_records(-1, np.empty((0, self.record_words), dtype=np.float32), np.empty(0, dtype=np.int64), False)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def segments(self) -> dict[int, Segment]:
        """The segments by number (retired ones too, until no reader pins them)."""
        return self.files.segments

    @property
    def segments_cleaned(self) -> int:
        return self.files.retired_count

    @property
    def records_moved(self) -> int:
        return self.cleaner.records_moved

    @property
    def disk_bytes(self) -> int:
        """Bytes of the segment files on disk (live and garbage records, and their keys)."""
        return sum(s.written for s in self.files.in_use()) * (self.record_bytes + KEY.itemsize)

    @property
    def live_bytes(self) -> int:
        return len(self.index) * self.record_bytes

    @property
    def index_bytes(self) -> int:
        """DRAM the index holds (the only per-row memory of this tier)."""
        return self.index.nbytes

    def counters(self) -> dict[str, int]:
        """So far: microseconds spent writing, cleaning and growing the index; segment
        files cleaned, the live records they moved, and the records of rows gone (expired)
        that cleaning deleted."""
        return {**self._timing, "index_grow_us": self.index.grow_us, "ssd_segments_cleaned": self.segments_cleaned,
                "ssd_records_moved": self.records_moved, "ssd_records_dropped": self.cleaner.records_dropped}

    # -- reads ---------------------------------------------------------------------------

    def read(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(found mask, rows [found, width], locations [found])`` of the rows stored here."""
        with self.lock:
            locations, probes = self.index.lookup(tables, ids)
            found = locations >= 0
            fds = self.files.descriptors()
            records = self.files.read(locations[found], fds)
            where = np.flatnonzero(found)
            head_tables, head_ids = record_keys(records)
            # Two keys may share the index's 32-bit hash: a record of another key means
            # the next candidate (or none).
            for k in np.flatnonzero((head_tables != tables[where]) | (head_ids != ids[where])):
                i = where[k]
                record, probe = int(locations[i]), int(probes[i])
                while True:
                    record, probe = self.index.next_candidate(int(tables[i]), int(ids[i]), probe)
                    if record < 0:
                        found[i] = False
                        break
                    candidate = self.files.read(np.array([record]), fds)
                    t, d = record_keys(candidate)
                    if t[0] == tables[i] and d[0] == ids[i]:
                        records[k], locations[i] = candidate[0], record
                        break
            keep = found[where]
            return found, np.ascontiguousarray(records[keep, HEADER_WORDS:]), locations[found]

    def may_hold(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Keys with a candidate record in the index (which may name another key sharing
        its hash: :meth:`read` tells); the others are not here."""
        with self.lock:
            return self.index.lookup(tables, ids)[0] >= 0

    def locate(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """``(locations, tokens, pinned)`` for a prefetch thread: each row's first candidate
        record (-1: none), a token that changes whenever the row's stored copy does, and the
        descriptors of their segments, pinned until :meth:`release`."""
        with self.lock:
            locations, _ = self.index.lookup(tables, ids)
            there = locations >= 0
            numbers = np.unique(locations[there] // self.segment_records)
            pinned = self.files.pin(numbers)
            generations = np.zeros(len(locations), dtype=np.int64)
            if there.any():
                lookup = np.array([self.segments[n].generation for n in numbers.tolist()], dtype=np.int64)
                generations[there] = lookup[np.searchsorted(numbers, locations[there] // self.segment_records)]
            return locations, np.where(there, locations | (generations << 32), -1), pinned

    def tokens(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The tokens :meth:`locate` would give, with no segment pinned."""
        locations, tokens, pinned = self.locate(tables, ids)
        self.release(pinned)
        return tokens

    def read_located(self, tables: np.ndarray, ids: np.ndarray, locations: np.ndarray,
                     pinned: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """``(ok, rows)``: the rows at located records whose header names their key (another
        key sharing the hash is left to a read on demand). No lock: a prefetch thread."""
        records = self.files.read(locations, pinned, BACKGROUND_READ_MIN)
        head_tables, head_ids = record_keys(records)
        ok = (head_tables == tables) & (head_ids == ids)
        return ok, np.ascontiguousarray(records[ok, HEADER_WORDS:])

    def release(self, pinned: dict[int, int]) -> None:
        with self.lock:
            self.files.unpin(pinned)

    # -- writes --------------------------------------------------------------------------

    def write(self, tables: np.ndarray, ids: np.ndarray, rows: np.ndarray,
              old: np.ndarray) -> tuple[np.ndarray, Relocated]:
        """Store rows (unique keys); ``old`` is each row's current record (-1: none here).
        Returns their new locations, and the rows a cleaning moved meanwhile."""
        if not len(ids):
            return np.empty(0, dtype=np.int64), Relocated()
        with self.lock:
            start = time.perf_counter()
            locations = self._append(tables, ids, rows, old)
            written = time.perf_counter()
            moved = self.cleaner.clean(budget=2 * len(ids))
            self._timing["ssd_write_us"] += int((written - start) * 1e6)
            self._timing["ssd_clean_us"] += int((time.perf_counter() - written) * 1e6)
            return locations, moved

    def _append(self, tables: np.ndarray, ids: np.ndarray, rows: np.ndarray, old: np.ndarray) -> np.ndarray:
        locations = self.files.append(make_records(tables, ids, rows), tables, ids)
        if self.rank is not None:
            last = self.rank(tables, rows)
            numbers = locations // self.segment_records
            for n in np.unique(numbers).tolist():
                segment = self.files.segments[n]
                if segment.newest is None:
                    segment.newest = np.full(len(self.table_names), NO_RECORD, dtype=np.int64)
                mine = numbers == n
                np.maximum.at(segment.newest, tables[mine], last[mine])
        # Only now do readers see the new copies.
        old = np.asarray(old, dtype=np.int64)
        self.index.put(tables, ids, old, locations)
        had = old >= 0
        if had.any():
            self.files.count_live(old[had], -1)
        self.files.count_live(locations, +1)
        return locations

    # -- snapshots -----------------------------------------------------------------------

    def entries(self, chunk_records: int = 1 << 16) -> Entries:
        """Every stored ``(tables, ids, rows)``, a chunk at a time (a segment in pieces)."""
        return self.snapshots.entries(chunk_records)

    def mark(self) -> tuple[int, int]:
        """Where the log ends now: :meth:`entries_since` gives the records written after."""
        return self.snapshots.mark()

    def entries_since(self, mark: tuple[int, int], chunk_records: int = 1 << 16) -> Entries:
        """As :meth:`LogSnapshots.entries_since`."""
        return self.snapshots.entries_since(mark, chunk_records)

    def active_entries(self, mark: tuple[int, int] | None = None, chunk_records: int = 1 << 16) -> Entries:
        """As :meth:`LogSnapshots.active_entries`."""
        return self.snapshots.active_entries(mark, chunk_records)

    def sealed(self, mark: tuple[int, int] | None = None) -> Iterator[SealedSegment]:
        """As :meth:`LogSnapshots.sealed`."""
        return self.snapshots.sealed(mark)

    def segment_entries(self, number: int, chunk_records: int = 1 << 16) -> Entries:
        """As :meth:`entries`, for one segment."""
        return self.snapshots.segment_entries(number, chunk_records)

    def can_adopt(self, record_bytes: int, records: int) -> bool:
        """As :meth:`LogSnapshots.can_adopt`."""
        return self.snapshots.can_adopt(record_bytes, records)

    def adopt(self, path: Path, keys_path: Path, records: int, crc: int, keys: np.ndarray, take: np.ndarray,
              newest: np.ndarray | None = None) -> bool:
        """As :meth:`LogSnapshots.adopt`."""
        return self.snapshots.adopt(path, keys_path, records, crc, keys, take, newest)

    # -- everything ------------------------------------------------------------------------

    def clear(self) -> None:
        with self.lock:
            for segment in self.files.in_use():
                self.files.retire(segment)
            self.files.active = None
            self.cleaner.cleaning = None
            self.index.clear()

    def __reduce_ex__(self, protocol: int) -> tuple:
        # A copy would share (and close) this one's open files, and write where it writes.
        raise TypeError(f"{type(self).__name__} of tables {self.table_names} in {self.directory} cannot be "
                        f"copied or pickled: a copy would share its files; save_tables / load_tables move rows "
                        f"into another SSD directory")

    def close(self) -> None:
        self.files.close()
        if self._claim is not None:
            self._claim.release()

    def __del__(self) -> None:
        self.close()
