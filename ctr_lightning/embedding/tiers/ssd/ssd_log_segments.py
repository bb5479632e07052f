"""The segment files of an SSD log: their records, and how they are made, filled, read,
sealed and deleted."""

from __future__ import annotations

import errno
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctr_lightning.embedding.tiers.ssd.location_index import MAX_RECORDS
from ctr_lightning.embedding.tiers.ssd.record_io import move_records
from ctr_lightning.embedding.tiers.ssd.ssd_tier import ssd_error
from ctr_lightning.fault_points import reached

HEADER_WORDS = 4  # float32 words before a record's row: id (int64), table (int32), unused (int32)
NO_RECORD = -(1 << 62)  # a segment's newest rank key of a table none of its records belongs to
# A record's key in the segment's keys file (slot order), so the live records of a sealed
# segment are known without reading it: a snapshot shares the segment by hard link.
KEY = np.dtype([("table", "<i4"), ("id", "<i8")])

# Reads in flight on one read of many records: an NVMe drive serves random reads faster with
# a few queued than one at a time, and more threads stop paying (benchmarks/bench_ssd_reads.py).
READ_THREADS = 4
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
            _pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="ctr-ssd-read")
        return _pool


def make_records(tables: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Whole records (header and row) of rows."""
    records = np.empty((len(ids), HEADER_WORDS + rows.shape[1]), dtype=np.float32)
    head = records[:, :HEADER_WORDS]
    head.view(np.int64)[:, 0] = ids
    head.view(np.int32)[:, 2] = tables
    head.view(np.int32)[:, 3] = 0
    records[:, HEADER_WORDS:] = rows
    return records


def record_keys(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(tables, ids)`` written in the headers of whole records (header and row)."""
    head = np.ascontiguousarray(records[:, :HEADER_WORDS])
    return head[:, 2].view(np.int32).astype(np.int64), head[:, :2].copy().view(np.int64)[:, 0]


@dataclass
class Segment:
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
    # Per table, the newest rank key of its records (its last lookup step, or a score's
    # bucket; NO_RECORD: none), where rows expire;
    # None: not known (adopted from a snapshot). A segment whose every table's newest is
    # below that table's floor holds only rows gone (see RowExpiry).
    newest: np.ndarray | None = None

    @property
    def keys_path(self) -> Path:
        return self.path.with_suffix(".keys")


class SegmentFiles:
    """The segment files of one SSD log, ``segment_records`` records each, and a keys file
    beside each. A location is ``number * segment_records + slot``; a number is reused once
    its segment is deleted, under a new generation. Appends go to the segment being filled
    (:attr:`active`); a segment is sealed when full (or closed off early) and retired when
    cleaned: deleted from disk, its descriptor closed once no reader pins it. Callers hold
    the log's lock.

    Example::

        files = SegmentFiles(Path("/nvme/run1"), "dim64", ["t0"], record_words=196, segment_records=1 << 16)
        locations = files.append(make_records(tables, ids, rows), tables, ids)
        records = files.read(locations, files.descriptors())
    """

    def __init__(self, directory: Path, name: str, table_names: list[str], record_words: int,
                 segment_records: int) -> None:
        self.directory = directory
        self.name = name
        self.table_names = table_names
        self.record_words = record_words
        self.record_bytes = record_words * 4
        self.segment_records = segment_records
        self.segments: dict[int, Segment] = {}
        self.active: Segment | None = None
        self.serials = 0  # the serial of the next segment
        self.retired_count = 0
        self.bytes_written = self.bytes_read = 0
        self._free_numbers: list[int] = []
        self._generations: dict[int, int] = {}

    def remove_stale(self) -> None:
        """Delete a previous run's segments (this log starts empty; a snapshot keeps its own links)."""
        for stale in [*self.directory.glob(f"{self.name}.*.seg"), *self.directory.glob(f"{self.name}.*.keys")]:
            stale.unlink()

    def fail(self, action: str, path: Path | str, err: int, needed: int = 0) -> OSError:
        return ssd_error(self.table_names, action, path, err, self.directory, needed)

    def split(self, locations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(segment numbers, slots)`` of locations."""
        return locations // self.segment_records, locations % self.segment_records

    def in_use(self) -> list[Segment]:
        """The segments on disk (not retired)."""
        return [s for s in self.segments.values() if not s.retired]

    def sealed(self) -> list[Segment]:
        """The segments on disk no append touches again."""
        return [s for s in self.segments.values() if not s.retired and s is not self.active]

    def descriptors(self) -> dict[int, int]:
        return {n: s.fd for n, s in self.segments.items()}

    # -- numbers and files -------------------------------------------------------------------

    def next_number(self) -> tuple[int, int, Path]:
        """``(number, generation, path)`` of the next segment."""
        retiring = sum(s.retired for s in self.segments.values())
        number = self._free_numbers.pop() if self._free_numbers else len(self.segments) + retiring
        while number in self.segments:
            number += 1
        if (number + 1) * self.segment_records - 1 > MAX_RECORDS:
            raise OverflowError(f"SSD tier of tables {self.table_names}: more than {MAX_RECORDS} records in "
                                f"{self.directory}; use larger segments or shard the tables over more ranks")
        generation = self._generations.get(number, -1) + 1
        self._generations[number] = generation
        return number, generation, self.directory / f"{self.name}.{number:06d}.{generation}.seg"

    def unnumber(self, number: int) -> None:
        """Give back a number :meth:`next_number` gave, no segment made of it."""
        self._generations[number] -= 1
        self._free_numbers.append(number)

    def add(self, number: int, generation: int, path: Path, create: bool, **fields) -> Segment:
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
            raise self.fail("creating" if create else "opening", file, e.errno) from e
        segment = Segment(number, path, fds[0], generation, self.serials, keys_fd=fds[1] if create else -1,
                          **fields)
        self.serials += 1
        self.segments[number] = segment
        return segment

    def seal_active(self) -> None:
        """No more appends to the segment being filled (full, or closed off early)."""
        if self.active is not None and self.active.keys_fd >= 0:
            os.close(self.active.keys_fd)
            self.active.keys_fd = -1
        self.active = None

    def retire(self, segment: Segment) -> None:
        segment.retired = True
        segment.path.unlink(missing_ok=True)  # open descriptors keep reading what they pinned
        segment.keys_path.unlink(missing_ok=True)
        self.retired_count += 1
        self.close_retired()

    def close_retired(self) -> None:
        for segment in [s for s in self.segments.values() if s.retired]:
            if segment.pins == 0:
                os.close(segment.fd)
                if segment.keys_fd >= 0:
                    os.close(segment.keys_fd)
                del self.segments[segment.number]
                self._free_numbers.append(segment.number)

    def pin(self, numbers: np.ndarray) -> dict[int, int]:
        """The descriptors of these segments, held open until :meth:`unpin`."""
        pinned = {}
        for n in numbers.tolist():
            segment = self.segments[n]
            segment.pins += 1
            pinned[n] = segment.fd
        return pinned

    def unpin(self, pinned: dict[int, int]) -> None:
        for n in pinned:
            segment = self.segments.get(n)
            if segment is not None and segment.fd == pinned[n]:
                segment.pins -= 1
        self.close_retired()

    def close(self) -> None:
        for segment in list(self.segments.values()):
            if segment.fd >= 0:
                os.close(segment.fd)
                segment.fd = -1
            if segment.keys_fd >= 0:
                os.close(segment.keys_fd)
                segment.keys_fd = -1
        self.segments.clear()

    # -- records -------------------------------------------------------------------------------

    def append(self, records: np.ndarray, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Append whole records (keys ``tables``, ``ids``), opening segments as they fill:
        their locations."""
        locations = np.empty(len(ids), dtype=np.int64)
        start = 0
        while start < len(ids):
            segment = self.active
            if segment is None or segment.written == self.segment_records:
                self.seal_active()
                segment = self.active = self.add(*self.next_number(), create=True)
            n = min(len(ids) - start, self.segment_records - segment.written)
            slots = np.arange(segment.written, segment.written + n, dtype=np.int64)
            try:
                move_records(segment.fd, records[start : start + n], slots, write=True)
            except OSError as e:
                raise self.fail("writing", segment.path, e.errno, needed=n * self.record_bytes) from e
            keys = np.empty(n, dtype=KEY)
            keys["table"], keys["id"] = tables[start : start + n], ids[start : start + n]
            try:
                if os.pwrite(segment.keys_fd, keys.tobytes(), segment.written * KEY.itemsize) != keys.nbytes:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as e:
                raise self.fail("writing", segment.keys_path, e.errno, needed=keys.nbytes) from e
            segment.crc = zlib.crc32(records[start : start + n], segment.crc)
            segment.written += n
            self.bytes_written += n * self.record_bytes
            reached("ssd_write")
            locations[start : start + n] = segment.number * self.segment_records + slots
            start += n
        return locations

    def count_live(self, locations: np.ndarray, change: int) -> None:
        """Add ``change`` to the live records of the segments of ``locations``, one a location."""
        numbers, counts = np.unique(locations // self.segment_records, return_counts=True)
        for n, c in zip(numbers.tolist(), counts.tolist()):
            self.segments[n].live += change * c

    def read(self, locations: np.ndarray, fds: dict[int, int], per_thread: int | None = None) -> np.ndarray:
        """Whole records (header and row) at ``locations`` (any order), read in ascending runs,
        by several threads from ``2 x per_thread`` records (default :data:`PARALLEL_READ_MIN`)."""
        out = np.empty((len(locations), self.record_words), dtype=np.float32)
        if not len(locations):
            return out
        order = np.argsort(locations, kind="stable")
        segments, slots = self.split(locations[order])
        buffer = np.empty_like(out)
        # Runs of one segment each, cut further into pieces read by parallel threads: a
        # drive serves random reads several times faster with a few in flight.
        cuts = np.flatnonzero(np.diff(segments)) + 1
        pieces = max(1, min(READ_THREADS, len(order) // (per_thread or PARALLEL_READ_MIN)))
        cuts = np.union1d(cuts, np.linspace(0, len(order), pieces + 1).astype(np.int64)[1:-1])
        bounds = list(zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [len(order)]]).tolist()))

        def read(lo: int, hi: int) -> None:
            try:
                move_records(fds[int(segments[lo])], buffer[lo:hi], slots[lo:hi], write=False)
            except OSError as e:
                raise self.fail("reading", self.segments[int(segments[lo])].path, e.errno) from e

        if pieces == 1:
            for lo, hi in bounds:
                read(lo, hi)
        else:
            for done in [_read_pool().submit(read, lo, hi) for lo, hi in bounds if hi > lo]:
                done.result()
        out[order] = buffer
        self.bytes_read += out.nbytes
        return out

    def sealed_keys(self, segment: Segment, durable: bool = True) -> np.ndarray:
        """The keys of a sealed segment's records, read from its keys file; with ``durable``
        (a snapshot shares them) both files are made durable first (once)."""
        action, path = "opening", segment.keys_path
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                action = "reading"
                keys = np.frombuffer(os.pread(fd, segment.written * KEY.itemsize, 0), dtype=KEY)
                if len(keys) != segment.written:
                    raise OSError(errno.EIO, "cut short")
                if durable and not segment.synced:
                    action = "syncing"
                    os.fsync(fd)
                    path = segment.path
                    os.fsync(segment.fd)
                    segment.synced = True
            finally:
                os.close(fd)
        except OSError as e:
            raise self.fail(action, path, e.errno) from e
        return keys
