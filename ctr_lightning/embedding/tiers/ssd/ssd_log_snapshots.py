"""What a table snapshot reads of an SSD log, and the segments a load gives back to it."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ctr_lightning.embedding.tiers.ssd.location_index import LocationIndex
from ctr_lightning.embedding.tiers.ssd.ssd_log_segments import HEADER_WORDS, SegmentFiles, record_keys
from ctr_lightning.embedding.tiers.ssd.ssd_tier import Entries, SealedSegment

# What link(2) answers where hard links cannot be made (another file system, or another
# mount of the same one): segments are then copied as rows instead of shared.
LINK_REFUSED = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP)


class LogSnapshots:
    """An SSD log's rows as a snapshot takes them: all of them or those written since a
    mark, a chunk at a time (a record is live while the index points at it); its sealed
    segments, whose files a snapshot hard-links; and sealed segments of a snapshot taken
    back by hard link (:meth:`adopt`). Takes the log's lock a chunk at a time.

    Example::

        view = LogSnapshots(files, index, lock)
        mark = view.mark()
        for tables, ids, rows in view.entries_since(mark): ...
    """

    def __init__(self, files: SegmentFiles, index: LocationIndex, lock: threading.Lock) -> None:
        self.files = files
        self.index = index
        self.lock = lock

    def entries(self, chunk_records: int = 1 << 16) -> Entries:
        """Every stored ``(tables, ids, rows)``, a chunk at a time (a segment in pieces)."""
        with self.lock:
            numbers = sorted(s.number for s in self.files.in_use())
        for number in numbers:
            yield from self._segment_entries(number, 0, chunk_records)

    def _segment_entries(self, number: int, first_slot: int, chunk_records: int) -> Entries:
        files = self.files
        segment = files.segments[number]
        for slot in range(first_slot, segment.written, chunk_records):
            with self.lock:
                slots = np.arange(slot, min(slot + chunk_records, segment.written), dtype=np.int64)
                locations = number * files.segment_records + slots
                records = files.read(locations, {number: segment.fd})
                tables, ids = record_keys(records)
                live = self.index.is_current(tables, ids, locations)
            if live.any():
                yield tables[live], ids[live], np.ascontiguousarray(records[live, HEADER_WORDS:])

    def mark(self) -> tuple[int, int]:
        """Where the log ends now: :meth:`entries_since` gives the records written after."""
        with self.lock:
            active = self.files.active
            return (active.serial, active.written) if active is not None else (self.files.serials, 0)

    def entries_since(self, mark: tuple[int, int], chunk_records: int = 1 << 16) -> Entries:
        """As :meth:`entries`, for the rows whose current record was written after ``mark``
        (every row written since, and some older ones a cleaning moved since)."""
        serial, written = mark
        with self.lock:
            numbers = sorted((s.serial, s.number) for s in self.files.in_use() if s.serial >= serial)
        for segment_serial, number in numbers:
            yield from self._segment_entries(number, written if segment_serial == serial else 0, chunk_records)

    def active_entries(self, mark: tuple[int, int] | None = None, chunk_records: int = 1 << 16) -> Entries:
        """As :meth:`entries`, for the segment being filled only (the others are
        :meth:`sealed`); with ``mark``, its records written after it."""
        active = self.files.active
        if active is None or active.retired or (mark is not None and active.serial < mark[0]):
            return
        first = mark[1] if mark is not None and active.serial == mark[0] else 0
        yield from self._segment_entries(active.number, first, chunk_records)

    def segment_entries(self, number: int, chunk_records: int = 1 << 16) -> Entries:
        """As :meth:`entries`, for one segment."""
        yield from self._segment_entries(number, 0, chunk_records)

    def sealed(self, mark: tuple[int, int] | None = None) -> Iterator[SealedSegment]:
        """The segments no write touches again, made durable (fsync), oldest first; with
        ``mark``, those that were not sealed at the mark. Keys come from their keys files,
        so no segment is read; the caller must not write meanwhile."""
        files = self.files
        with self.lock:
            segments = sorted((s.serial, s.number) for s in files.sealed() if mark is None or s.serial >= mark[0])
        for _, number in segments:
            with self.lock:
                segment = files.segments[number]
                keys = files.sealed_keys(segment)
                locations = number * files.segment_records + np.arange(segment.written, dtype=np.int64)
                live = self.index.is_current(keys["table"], keys["id"], locations)
            yield SealedSegment(number, segment.path, segment.keys_path, segment.written, segment.crc, keys, live,
                                segment.newest)

    def can_adopt(self, record_bytes: int, records: int) -> bool:
        """Whether a sealed segment of these dimensions fits this log's record numbers."""
        return record_bytes == self.files.record_bytes and records <= self.files.segment_records

    def adopt(self, path: Path, keys_path: Path, records: int, crc: int, keys: np.ndarray, take: np.ndarray,
              newest: np.ndarray | None = None) -> bool:
        """Make a sealed segment of another log (a snapshot's hard link) one of this log's
        by hard link, its records at ``take`` live (keys absent here). False, with nothing
        changed, where the files cannot be linked (another file system)."""
        files = self.files
        with self.lock:
            # Appends go to a new segment from here: the mark a load ends with then lies
            # after every adopted segment, and the next incremental snapshot links none again.
            files.seal_active()
            number, generation, dest = files.next_number()
            linked = []
            try:
                for source, target in ((path, dest), (keys_path, dest.with_suffix(".keys"))):
                    os.link(source, target)
                    linked.append(target)
            except OSError as e:
                for target in linked:
                    target.unlink(missing_ok=True)
                if e.errno in LINK_REFUSED:
                    files.unnumber(number)
                    return False
                raise OSError(e.errno, f"SSD tier of tables {files.table_names}: linking {source} as {target} "
                                       f"failed: {os.strerror(e.errno)}") from e
            slots = np.flatnonzero(take)
            files.add(number, generation, dest, create=False, written=records, live=len(slots), crc=crc, synced=True,
                      newest=None if newest is None else np.array(newest, dtype=np.int64))
            self.index.put(keys["table"][slots], keys["id"][slots], np.full(len(slots), -1, dtype=np.int64),
                           number * files.segment_records + slots)
            return True
