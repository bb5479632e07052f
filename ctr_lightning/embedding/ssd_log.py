"""The SSD tier of tables with hashed ids: a log of segment files, cleaned a piece at a time."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ctr_lightning.embedding.directory_lock import DirectoryLock
from ctr_lightning.embedding.key_index import dedup
from ctr_lightning.embedding.location_index import MAX_RECORDS, LocationIndex
from ctr_lightning.embedding.record_io import move_records, transfer_records
from ctr_lightning.fault_points import reached

_HEADER = 4  # float32 words before a record's row: id (int64), table (int32), unused (int32)
# A record's key in the segment's keys file (slot order), so the live records of a sealed
# segment are known without reading it: a snapshot shares the segment by hard link.
KEY = np.dtype([("table", "<i4"), ("id", "<i8")])
# What link(2) answers where hard links cannot be made (another file system, or another
# mount of the same one): segments are then copied as rows instead of shared.
LINK_REFUSED = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP)


# Reads in flight on one read of many records: an NVMe drive serves random reads faster with
# a few queued than one at a time, and more threads stop paying (benchmarks/bench_ssd_reads.py).
_READ_THREADS = 4
# Records a thread, at least, for a read a step waits on (parallel from 512 records): low
# enough that a step's few thousand rows are read in parallel, not one at a time
# (benchmarks/bench_ssd_reads.py, docs/benchmarks.md).
PARALLEL_READ_MIN = 256
# The same for reads in a background thread (read-ahead, cleaning): they overlap the step's
# compute, and more threads there take cores from it, for rows the page cache often holds.
BACKGROUND_READ_MIN = 2048
_pool: ThreadPoolExecutor | None = None


_pool_lock = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:  # the training and prefetch threads may both ask first
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="ctr-ssd-read")
        return _pool


# What an SSD tier's counters read before it has done anything (and always, without one).
NO_SSD_COUNTERS = {"ssd_write_us": 0, "ssd_clean_us": 0, "index_grow_us": 0, "ssd_segments_cleaned": 0,
                   "ssd_records_moved": 0}


@dataclass
class _Segment:
    number: int
    path: Path
    fd: int
    generation: int  # counts the reuses of this number, so a location names one copy of a row, ever
    serial: int  # order of creation among all segments: records of later serials were written later
    written: int = 0  # records appended
    live: int = 0  # records the index points at
    pins: int = 0  # readers holding its descriptor (a prefetch thread)
    retired: bool = False  # deleted from disk; its descriptor closes once unpinned
    keys_fd: int = -1  # the keys file (each record's (table, id), in slot order): open while appended to
    crc: int = 0  # CRC-32 of the file as written so far (appends only): no re-read to share it
    synced: bool = False  # fsynced since sealed (a snapshot shares it)

    @property
    def keys_path(self) -> Path:
        return self.path.with_suffix(".keys")


@dataclass(frozen=True)
class SealedSegment:
    """A segment no write will touch again: its files, record count, CRC-32, the keys of
    its records (slot order) and which of them are live (the index points at them)."""

    number: int
    path: Path
    keys_path: Path
    records: int
    crc: int
    keys: np.ndarray  # KEY [records]
    live: np.ndarray  # bool [records]


@dataclass
class Relocated:
    """Rows whose SSD copy moved (written anew, or moved by a cleaning): memory tiers that
    hold a copy must learn the new record."""

    tables: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    locations: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @staticmethod
    def merged(parts: list[Relocated]) -> Relocated:
        """One entry a row, its latest location (later parts win)."""
        parts = [p for p in parts if len(p.ids)]
        if len(parts) <= 1:
            return parts[0] if parts else Relocated()
        tables, ids, locations = (np.concatenate(x) for x in zip(*((p.tables, p.ids, p.locations) for p in parts)))
        last = len(ids) - 1 - dedup(tables[::-1], ids[::-1])[0]
        return Relocated(tables[last], ids[last], locations[last])


class SsdLog:
    """Rows of tables with hashed (any 64-bit) ids, as a log of fixed-size records.

    A record is a header (id, table) and the row (weights and optimizer state). Writes
    append to the newest segment file, ``segment_bytes`` each, in one ``pwrite`` a run,
    and only then point the :class:`LocationIndex` at them, so a failed write leaves the
    old copies in force. A record's location (segment number and slot) names one copy of
    one row: a row rewritten or moved gets a new one.

    Rewriting a row leaves its old record as garbage. After each write, while the files
    hold more than ``1 + max_garbage`` times the live records (beyond the segment being
    filled), the segment with the least live share is cleaned: its live records are
    appended anew and the file deleted, at most twice the records just written per call,
    so no step waits on a whole cleaning, and the files stay within about
    ``1 + max_garbage`` times the live rows. Moved rows are returned (:class:`Relocated`),
    so memory tiers that hold a copy keep its location current.

    The index holds 8 bytes an entry (10-15 a row); keys live only in the records' headers.

    Example::

        log = SsdLog("/nvme/run1", "dim64", width=192, table_names=["t0"])
        locations, moved = log.write(tables, ids, rows, old=np.full(len(ids), -1))
        found, rows, locations = log.read(tables, ids)
    """

    def __init__(self, directory: str | os.PathLike, name: str, width: int, table_names: list[str],
                 segment_bytes: int = 256 << 20, max_garbage: float = 0.3) -> None:
        self.directory = Path(directory)
        self.name = name
        self.width = width
        self.table_names = table_names
        self.record_words = _HEADER + width
        self.record_bytes = self.record_words * 4
        self.segment_records = max(1, segment_bytes // self.record_bytes)
        self.max_garbage = max_garbage
        self.index = LocationIndex()
        self.segments: dict[int, _Segment] = {}
        self._free_numbers: list[int] = []
        self._generations: dict[int, int] = {}
        self._serials = 0
        self._active: _Segment | None = None
        self._cleaning: tuple[int, int] | None = None  # (segment, next slot) of a cleaning under way
        self.bytes_written = self.bytes_read = 0
        self.records_moved = 0
        self.segments_cleaned = 0
        self._timing = {"ssd_write_us": 0, "ssd_clean_us": 0}
        # Held while the layout changes and while a prefetch thread locates rows; reading
        # located records needs no lock (their segments are pinned meanwhile).
        self.lock = threading.Lock()
        self._claim: DirectoryLock | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"SSD tier of tables {table_names}: cannot create files in "
                                   f"{self.directory}: {e.strerror}") from e
        # Before anything there is deleted: the files of another live run are not stale.
        self._claim = claim_directory(self.directory, table_names)
        try:
            for stale in [*self.directory.glob(f"{name}.*.seg"), *self.directory.glob(f"{name}.*.keys")]:
                stale.unlink()  # a previous run's: this one starts empty (a snapshot keeps its own links)
        except OSError as e:
            raise OSError(e.errno, f"SSD tier of tables {table_names}: cannot create files in "
                                   f"{self.directory}: {e.strerror}") from e
        # Compiled now, not in the middle of the step whose evictions first reach the SSD.
        transfer_records(-1, np.empty((0, self.record_words), dtype=np.float32), np.empty(0, dtype=np.int64), False)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the segment files on disk (live and garbage records, and their keys)."""
        return sum(s.written for s in self.segments.values() if not s.retired) * (self.record_bytes + KEY.itemsize)

    @property
    def live_bytes(self) -> int:
        return len(self.index) * self.record_bytes

    @property
    def index_bytes(self) -> int:
        """DRAM the index holds (the only per-row memory of this tier)."""
        return self.index.nbytes

    def counters(self) -> dict[str, int]:
        """So far: microseconds spent writing, cleaning and growing the index; segment
        files cleaned and the live records they moved."""
        return {**self._timing, "index_grow_us": self.index.grow_us, "ssd_segments_cleaned": self.segments_cleaned,
                "ssd_records_moved": self.records_moved}

    # -- locations -----------------------------------------------------------------------

    def _split(self, locations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return locations // self.segment_records, locations % self.segment_records

    def _fail(self, action: str, path: Path | str, err: int, needed: int = 0) -> OSError:
        return ssd_error(self.table_names, action, path, err, self.directory, needed)

    def _next_number(self) -> tuple[int, int, Path]:
        """``(number, generation, path)`` of the next segment."""
        number = self._free_numbers.pop() if self._free_numbers else len(self.segments) + len(self._retiring())
        while number in self.segments:
            number += 1
        if (number + 1) * self.segment_records - 1 > MAX_RECORDS:
            raise OverflowError(f"SSD tier of tables {self.table_names}: more than {MAX_RECORDS} records in "
                                f"{self.directory}; use larger segments or shard the tables over more ranks")
        generation = self._generations.get(number, -1) + 1
        self._generations[number] = generation
        return number, generation, self.directory / f"{self.name}.{number:06d}.{generation}.seg"

    def _add_segment(self, number: int, generation: int, path: Path, create: bool, **fields) -> _Segment:
        """A new segment to append to (``create``), or a sealed one taken over (adopted:
        read only, its keys file opened when needed: one descriptor a sealed segment)."""
        files = (path, path.with_suffix(".keys")) if create else (path,)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC if create else os.O_RDONLY
        fds = []
        try:
            for file in files:
                fds.append(os.open(file, flags, 0o644))
        except OSError as e:
            for fd in fds:
                os.close(fd)
            raise self._fail("creating" if create else "opening", file, e.errno) from e
        segment = _Segment(number, path, fds[0], generation, self._serials, keys_fd=fds[1] if create else -1,
                           **fields)
        self._serials += 1
        self.segments[number] = segment
        return segment

    def _new_segment(self) -> _Segment:
        self._seal_active()
        return self._add_segment(*self._next_number(), create=True)

    def _seal_active(self) -> None:
        """No more appends to the segment being filled (full, or closed off early)."""
        if self._active is not None and self._active.keys_fd >= 0:
            os.close(self._active.keys_fd)
            self._active.keys_fd = -1
        self._active = None

    def _retiring(self) -> list[_Segment]:
        return [s for s in self.segments.values() if s.retired]

    # -- reads ---------------------------------------------------------------------------

    def _read_records(self, locations: np.ndarray, fds: dict[int, int], per_thread: int | None = None) -> np.ndarray:
        """Whole records (header and row) at ``locations`` (any order), read in ascending runs,
        by several threads from ``2 x per_thread`` records (default :data:`PARALLEL_READ_MIN`)."""
        out = np.empty((len(locations), self.record_words), dtype=np.float32)
        if not len(locations):
            return out
        order = np.argsort(locations, kind="stable")
        segments, slots = self._split(locations[order])
        buffer = np.empty_like(out)
        # Runs of one segment each, cut further into pieces read by parallel threads: a
        # drive serves random reads several times faster with a few in flight.
        cuts = np.flatnonzero(np.diff(segments)) + 1
        pieces = max(1, min(_READ_THREADS, len(order) // (per_thread or PARALLEL_READ_MIN)))
        cuts = np.union1d(cuts, np.linspace(0, len(order), pieces + 1).astype(np.int64)[1:-1])
        bounds = list(zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [len(order)]]).tolist()))

        def read(lo: int, hi: int) -> None:
            try:
                move_records(fds[int(segments[lo])], buffer[lo:hi], slots[lo:hi], write=False)
            except OSError as e:
                raise self._fail("reading", self.segments[int(segments[lo])].path, e.errno) from e

        if pieces == 1:
            for lo, hi in bounds:
                read(lo, hi)
        else:
            for done in [_read_pool().submit(read, lo, hi) for lo, hi in bounds if hi > lo]:
                done.result()
        out[order] = buffer
        self.bytes_read += out.nbytes
        return out

    def read(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(found mask, rows [found, width], locations [found])`` of the rows stored here."""
        with self.lock:
            locations, probes = self.index.lookup(tables, ids)
            found = locations >= 0
            fds = {n: s.fd for n, s in self.segments.items()}
            records = self._read_records(locations[found], fds)
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
                    candidate = self._read_records(np.array([record]), fds)
                    t, d = record_keys(candidate)
                    if t[0] == tables[i] and d[0] == ids[i]:
                        records[k], locations[i] = candidate[0], record
                        break
            keep = found[where]
            return found, np.ascontiguousarray(records[keep, _HEADER:]), locations[found]

    def locate(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """``(locations, tokens, pinned)`` for a prefetch thread: each row's first candidate
        record (-1: none), a token that changes whenever the row's stored copy does, and the
        descriptors of their segments, pinned until :meth:`release`."""
        with self.lock:
            locations, _ = self.index.lookup(tables, ids)
            there = locations >= 0
            numbers = np.unique(locations[there] // self.segment_records)
            pinned = {}
            for n in numbers.tolist():
                segment = self.segments[n]
                segment.pins += 1
                pinned[n] = segment.fd
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
        records = self._read_records(locations, pinned, BACKGROUND_READ_MIN)
        head_tables, head_ids = record_keys(records)
        ok = (head_tables == tables) & (head_ids == ids)
        return ok, np.ascontiguousarray(records[ok, _HEADER:])

    def release(self, pinned: dict[int, int]) -> None:
        with self.lock:
            for n in pinned:
                segment = self.segments.get(n)
                if segment is not None and segment.fd == pinned[n]:
                    segment.pins -= 1
            self._close_retired()

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
            moved = self._clean(budget=2 * len(ids))
            self._timing["ssd_write_us"] += int((written - start) * 1e6)
            self._timing["ssd_clean_us"] += int((time.perf_counter() - written) * 1e6)
            return locations, moved

    def _append(self, tables: np.ndarray, ids: np.ndarray, rows: np.ndarray, old: np.ndarray) -> np.ndarray:
        records = np.empty((len(ids), self.record_words), dtype=np.float32)
        head = records[:, :_HEADER]
        head.view(np.int64)[:, 0] = ids
        head.view(np.int32)[:, 2] = tables
        head.view(np.int32)[:, 3] = 0
        records[:, _HEADER:] = rows
        locations = np.empty(len(ids), dtype=np.int64)
        start = 0
        while start < len(ids):
            segment = self._active
            if segment is None or segment.written == self.segment_records:
                segment = self._active = self._new_segment()
            n = min(len(ids) - start, self.segment_records - segment.written)
            slots = np.arange(segment.written, segment.written + n, dtype=np.int64)
            try:
                move_records(segment.fd, records[start : start + n], slots, write=True)
            except OSError as e:
                raise self._fail("writing", segment.path, e.errno, needed=n * self.record_bytes) from e
            keys = np.empty(n, dtype=KEY)
            keys["table"], keys["id"] = tables[start : start + n], ids[start : start + n]
            try:
                if os.pwrite(segment.keys_fd, keys.tobytes(), segment.written * KEY.itemsize) != keys.nbytes:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as e:
                raise self._fail("writing", segment.keys_path, e.errno, needed=keys.nbytes) from e
            segment.crc = zlib.crc32(records[start : start + n], segment.crc)
            segment.written += n
            self.bytes_written += n * self.record_bytes
            reached("ssd_write")
            locations[start : start + n] = segment.number * self.segment_records + slots
            start += n
        # Only now do readers see the new copies.
        old = np.asarray(old, dtype=np.int64)
        self.index.put(tables, ids, old, locations)
        had = old >= 0
        if had.any():
            numbers, counts = np.unique(old[had] // self.segment_records, return_counts=True)
            for n, c in zip(numbers.tolist(), counts.tolist()):
                self.segments[n].live -= c
        numbers, counts = np.unique(locations // self.segment_records, return_counts=True)
        for n, c in zip(numbers.tolist(), counts.tolist()):
            self.segments[n].live += c
        return locations

    def _garbage_over(self) -> bool:
        sealed = [s for s in self.segments.values() if not s.retired and s is not self._active]
        written = sum(s.written for s in sealed)
        live = sum(s.live for s in sealed)
        return written > (1 + self.max_garbage) * live and written > 0

    def _clean(self, budget: int) -> Relocated:
        """Move up to ``budget`` live records out of the emptiest segments while garbage is over."""
        moved: list[Relocated] = []
        while budget > 0 and (self._cleaning is not None or self._garbage_over()):
            if self._cleaning is None:
                sealed = [s for s in self.segments.values() if not s.retired and s is not self._active]
                victim = min(sealed, key=lambda s: (s.live / max(s.written, 1), s.number))
                self._cleaning = (victim.number, 0)
            number, slot = self._cleaning
            victim = self.segments[number]
            take = min(budget, victim.written - slot, 1 << 16)
            slots = np.arange(slot, slot + take, dtype=np.int64)
            locations = number * self.segment_records + slots
            records = self._read_records(locations, {number: victim.fd}, BACKGROUND_READ_MIN)
            tables, ids = record_keys(records)
            live = self.index.is_current(tables, ids, locations)
            if live.any():
                new = self._append(tables[live], ids[live], records[live, _HEADER:], locations[live])
                moved.append(Relocated(tables[live], ids[live], new))
                self.records_moved += int(live.sum())
                reached("ssd_clean")
            budget -= max(take, 1)
            if slot + take >= victim.written:
                self._retire(victim)
                self._cleaning = None
            else:
                self._cleaning = (number, slot + take)
        return Relocated.merged(moved)

    def _retire(self, segment: _Segment) -> None:
        segment.retired = True
        segment.path.unlink(missing_ok=True)  # open descriptors keep reading what they pinned
        segment.keys_path.unlink(missing_ok=True)
        self.segments_cleaned += 1
        self._close_retired()

    def _close_retired(self) -> None:
        for segment in self._retiring():
            if segment.pins == 0:
                os.close(segment.fd)
                if segment.keys_fd >= 0:
                    os.close(segment.keys_fd)
                del self.segments[segment.number]
                self._free_numbers.append(segment.number)

    # -- everything ------------------------------------------------------------------------

    def entries(self, chunk_records: int = 1 << 16):
        """Every stored ``(tables, ids, rows)``, a chunk at a time (a segment in pieces)."""
        with self.lock:
            numbers = sorted(n for n, s in self.segments.items() if not s.retired)
        for number in numbers:
            yield from self._segment_entries(number, 0, chunk_records)

    def _segment_entries(self, number: int, first_slot: int, chunk_records: int):
        segment = self.segments[number]
        for slot in range(first_slot, segment.written, chunk_records):
            with self.lock:
                slots = np.arange(slot, min(slot + chunk_records, segment.written), dtype=np.int64)
                locations = number * self.segment_records + slots
                records = self._read_records(locations, {number: segment.fd})
                tables, ids = record_keys(records)
                live = self.index.is_current(tables, ids, locations)
            if live.any():
                yield tables[live], ids[live], np.ascontiguousarray(records[live, _HEADER:])

    def mark(self) -> tuple[int, int]:
        """Where the log ends now: :meth:`entries_since` gives the records written after."""
        with self.lock:
            active = self._active
            return (active.serial, active.written) if active is not None else (self._serials, 0)

    def entries_since(self, mark: tuple[int, int], chunk_records: int = 1 << 16):
        """As :meth:`entries`, for the rows whose current record was written after ``mark``
        (every row written since, and some older ones a cleaning moved since)."""
        serial, written = mark
        with self.lock:
            numbers = sorted((s.serial, n) for n, s in self.segments.items() if not s.retired and s.serial >= serial)
        for segment_serial, number in numbers:
            yield from self._segment_entries(number, written if segment_serial == serial else 0, chunk_records)

    def active_entries(self, mark: tuple[int, int] | None = None, chunk_records: int = 1 << 16):
        """As :meth:`entries`, for the segment being filled only (the others are
        :meth:`sealed`); with ``mark``, its records written after it."""
        active = self._active
        if active is None or active.retired or (mark is not None and active.serial < mark[0]):
            return
        first = mark[1] if mark is not None and active.serial == mark[0] else 0
        yield from self._segment_entries(active.number, first, chunk_records)

    def sealed(self, mark: tuple[int, int] | None = None) -> Iterator[SealedSegment]:
        """The segments no write touches again, made durable (fsync), oldest first; with
        ``mark``, those that were not sealed at the mark. Keys come from their keys files,
        so no segment is read; the caller must not write meanwhile."""
        with self.lock:
            segments = sorted((s.serial, n) for n, s in self.segments.items()
                              if not s.retired and s is not self._active and (mark is None or s.serial >= mark[0]))
        for _, number in segments:
            with self.lock:
                segment = self.segments[number]
                keys = self._sealed_keys(segment)
                locations = number * self.segment_records + np.arange(segment.written, dtype=np.int64)
                live = self.index.is_current(keys["table"], keys["id"], locations)
            yield SealedSegment(number, segment.path, segment.keys_path, segment.written, segment.crc, keys, live)

    def _sealed_keys(self, segment: _Segment) -> np.ndarray:
        """The keys of a sealed segment's records, read from its keys file; both files are
        made durable first (once)."""
        action, path = "opening", segment.keys_path
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                action = "reading"
                keys = np.frombuffer(os.pread(fd, segment.written * KEY.itemsize, 0), dtype=KEY)
                if len(keys) != segment.written:
                    raise OSError(errno.EIO, "cut short")
                if not segment.synced:
                    action = "syncing"
                    os.fsync(fd)
                    path = segment.path
                    os.fsync(segment.fd)
                    segment.synced = True
            finally:
                os.close(fd)
        except OSError as e:
            raise self._fail(action, path, e.errno) from e
        return keys

    def segment_entries(self, number: int, chunk_records: int = 1 << 16):
        """As :meth:`entries`, for one segment."""
        yield from self._segment_entries(number, 0, chunk_records)

    def can_adopt(self, record_bytes: int, records: int) -> bool:
        """Whether a sealed segment of these dimensions fits this log's record numbers."""
        return record_bytes == self.record_bytes and records <= self.segment_records

    def adopt(self, path: Path, keys_path: Path, records: int, crc: int, keys: np.ndarray, take: np.ndarray) -> bool:
        """Make a sealed segment of another log (a snapshot's hard link) one of this log's
        by hard link, its records at ``take`` live (keys absent here). False, with nothing
        changed, where the files cannot be linked (another file system)."""
        with self.lock:
            # Appends go to a new segment from here: the mark a load ends with then lies
            # after every adopted segment, and the next incremental snapshot links none again.
            self._seal_active()
            number, generation, dest = self._next_number()
            linked = []
            try:
                for source, target in ((path, dest), (keys_path, dest.with_suffix(".keys"))):
                    os.link(source, target)
                    linked.append(target)
            except OSError as e:
                for target in linked:
                    target.unlink(missing_ok=True)
                if e.errno in LINK_REFUSED:
                    self._generations[number] -= 1
                    self._free_numbers.append(number)
                    return False
                raise OSError(e.errno, f"SSD tier of tables {self.table_names}: linking {source} as {target} "
                                       f"failed: {os.strerror(e.errno)}") from e
            slots = np.flatnonzero(take)
            self._add_segment(number, generation, dest, create=False, written=records, live=len(slots), crc=crc,
                              synced=True)
            self.index.put(keys["table"][slots], keys["id"][slots], np.full(len(slots), -1, dtype=np.int64),
                           number * self.segment_records + slots)
            return True

    def clear(self) -> None:
        with self.lock:
            for segment in list(self.segments.values()):
                if not segment.retired:
                    self._retire(segment)
            self._active = None
            self._cleaning = None
            self.index.clear()

    def __reduce_ex__(self, protocol: int) -> tuple:
        # A copy would share (and close) this one's open files, and write where it writes.
        raise TypeError(f"{type(self).__name__} of tables {self.table_names} in {self.directory} cannot be "
                        f"copied or pickled: a copy would share its files; save_tables / load_tables move rows "
                        f"into another SSD directory")

    def close(self) -> None:
        for segment in list(self.segments.values()):
            if segment.fd >= 0:
                os.close(segment.fd)
                segment.fd = -1
            if segment.keys_fd >= 0:
                os.close(segment.keys_fd)
                segment.keys_fd = -1
        self.segments.clear()
        if self._claim is not None:
            self._claim.release()

    def __del__(self) -> None:
        self.close()


def record_keys(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(tables, ids)`` written in the headers of whole records (header and row)."""
    head = np.ascontiguousarray(records[:, :_HEADER])
    return head[:, 2].view(np.int32).astype(np.int64), head[:, :2].copy().view(np.int64)[:, 0]


def claim_directory(directory: Path, table_names: list[str]) -> DirectoryLock:
    """This process's claim on an SSD directory: another run's tiers there are refused."""
    return DirectoryLock(directory, f"SSD tier of tables {table_names}", "StorageConfig.ssd_dir")


def ssd_error(table_names: list[str], action: str, path: Path | str, err: int, directory: Path,
              needed: int = 0) -> OSError:
    """The error of a failed read or write of an SSD tier's file, with its errno; a full
    disk names the directory's free bytes and the bytes the write needed."""
    cause = os.strerror(err)
    if err == errno.ENOSPC:
        try:
            free = f"{shutil.disk_usage(directory).free} bytes"
        except OSError:
            free = "an unknown number of bytes"
        cause += (f": {directory} has {free} free and the write needed {needed} bytes; free space there "
                  f"or choose another ssd_dir (StorageConfig.ssd_dir)")
    return OSError(err, f"SSD tier of tables {table_names}: {action} {path} failed: {cause}; "
                        f"rows already written are intact")
