"""Record files of the SSD tier, and the store of tables with bounded ids (a record per id).

Tables with hashed ids are kept in :class:`ctr_lightning.embedding.tiers.ssd.ssd_log.SsdLog`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ctr_lightning.embedding.tiers.ssd.record_io import move_records
from ctr_lightning.embedding.tiers.ssd.ssd_tier import (NO_SSD_COUNTERS, Entries, Relocated, SealedSegment, claim_directory,
                                              ssd_error)


class RecordFile:
    """A file of fixed-size float32 records, read and written in compiled pread/pwrite loops;
    :class:`DirectSsdStore` decides where a (table, id) lives in it.

    Writes are plain ``pwrite`` calls (not a memory map), so a full disk is an ENOSPC
    error right there; the tier costs page cache, not process memory. (No posix_fallocate:
    on ext4 a write into reserved extents also converts them to written ones, which made
    writes slower, not faster.)
    """

    def __init__(self, directory: str | os.PathLike, name: str, width: int, table_names: list[str]) -> None:
        self.directory = Path(directory)
        self.width = width
        self.table_names = table_names
        self.record_bytes = width * 4
        self.fd = -1
        self._claim = None
        self.path = self.directory / f"{name}.rows"
        self._claim = claim_directory(self.directory, table_names)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise OSError(e.errno, f"SSD tier of tables {table_names}: cannot create files in "
                                   f"{self.directory}: {e.strerror}") from e
        self.bytes_written = 0
        self.bytes_read = 0
        # Held while the records change (writes, marks, clears) and while a prefetch thread
        # locates rows; reading located records needs no lock (see :meth:`read_located`).
        self.lock = threading.Lock()

    def _fail(self, action: str, err: int, needed: int = 0) -> OSError:
        return ssd_error(self.table_names, action, self.path, err, self.directory, needed)

    def _read(self, fd: int, records: np.ndarray) -> np.ndarray:
        """Rows at ``records`` (any order), read in ascending runs."""
        out = np.empty((len(records), self.width), dtype=np.float32)
        if len(records):
            order = np.argsort(records, kind="stable")
            ordered = records[order]
            sorted_out = np.empty_like(out)
            try:
                move_records(fd, sorted_out, ordered, write=False)
            except OSError as e:
                raise self._fail("reading", e.errno) from e
            out[order] = sorted_out
            self.bytes_read += out.nbytes
        return out

    def _write(self, fd: int, rows: np.ndarray, records: np.ndarray, action: str = "writing") -> None:
        """Rows to ``records`` (any order), written in ascending runs."""
        order = np.argsort(records, kind="stable")
        records = records[order]
        rows = np.ascontiguousarray(rows[order], dtype=np.float32)
        try:
            move_records(fd, rows, records, write=True)
        except OSError as e:
            raise self._fail(action, e.errno, needed=rows.nbytes) from e
        self.bytes_written += rows.nbytes

    def __reduce_ex__(self, protocol: int) -> tuple:
        # A copy would share (and close) this one's open files, and write where it writes.
        raise TypeError(f"{type(self).__name__} of tables {self.table_names} in {self.directory} cannot be "
                        f"copied or pickled: a copy would share its files; save_tables / load_tables move rows "
                        f"into another SSD directory")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._claim is not None:
            self._claim.release()

    def __del__(self) -> None:
        self.close()


class DirectSsdStore(RecordFile):
    """Rows of tables with bounded ids, each at a fixed record: table base + id; an
    :class:`~ctr_lightning.embedding.tiers.ssd.ssd_tier.SsdTier` without segments to share.

    No index: one 32-bit version per possible row (0: never stored), in a calloc'ed
    array whose pages cost memory only where rows were stored, so DRAM use stays flat
    however large the tables grow. The file is sparse; rows are written in place, and
    each write bumps the row's version, which a prefetch thread's reads are checked by.

    Example::

        store = DirectSsdStore("/nvme/run1", "dim64", width=192, table_names=["t0"],
                               num_embeddings=[10**9])
    """

    shares_segments = False  # one sparse file written in place: a snapshot copies its rows

    def __init__(self, directory: str | os.PathLike, name: str, width: int, table_names: list[str],
                 num_embeddings: list[int]) -> None:
        super().__init__(directory, name, width, table_names)
        self.base = np.concatenate([[0], np.cumsum(num_embeddings)[:-1]]).astype(np.int64)
        self.version = np.zeros(int(np.sum(num_embeddings)), dtype=np.uint32)
        # Records written since the last mark(); calloc'ed too, so pages only where written.
        self.changed = np.zeros(len(self.version), dtype=bool)
        self.clears = 0

    def __len__(self) -> int:
        return int(np.count_nonzero(self.version))

    @property
    def disk_bytes(self) -> int:
        return len(self) * self.record_bytes  # the file is sparse: pages only where rows were stored

    @property
    def live_bytes(self) -> int:
        return len(self) * self.record_bytes

    def counters(self) -> dict[str, int]:
        """As :meth:`SsdLog.counters`: nothing to clean or grow here."""
        return dict(NO_SSD_COUNTERS)

    @property
    def index_bytes(self) -> int:
        """The version array's resident pages (calloc'ed: only where rows were stored)."""
        return min(self.version.nbytes, 4096 * len(self))

    def read(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(found mask, rows [found, width], locations [found])``, as :meth:`SsdLog.read`."""
        with self.lock:
            records = self.base[tables] + ids
            found = self.version[records] > 0
            return found, self._read(self.fd, records[found]), records[found]

    def may_hold(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Exactly the keys stored here (a version is kept for every possible row)."""
        with self.lock:
            return self.version[self.base[tables] + ids] > 0

    def locate(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """As :meth:`SsdLog.locate`; the token is the row's version."""
        with self.lock:
            records = self.base[tables] + ids
            version = self.version[records].astype(np.int64)
            return (np.where(version > 0, records, -1), np.where(version > 0, version + (self.clears << 32), -1),
                    {0: self.fd})

    def tokens(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return self.locate(tables, ids)[1]

    def read_located(self, tables: np.ndarray, ids: np.ndarray, locations: np.ndarray,
                     pinned: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """``(ok, rows)`` at located records, read without the lock (by a prefetch thread);
        a write meanwhile changes the row's version, which its token is checked against."""
        return np.ones(len(locations), dtype=bool), self._read(pinned[0], locations)

    def release(self, pinned: dict[int, int]) -> None:
        pass  # one file, never closed while the store lives

    def write(self, tables: np.ndarray, ids: np.ndarray, rows: np.ndarray,
              old: np.ndarray) -> tuple[np.ndarray, Relocated]:
        """Store rows in place (``old`` plays no part: a row has one record)."""
        records = self.base[tables] + ids
        if not len(ids):
            return records, Relocated()
        with self.lock:
            self._write(self.fd, rows, records)
            # Bumped after the data: a read racing the write sees a new version later.
            version = self.version[records] + np.uint32(1)
            self.version[records] = np.where(version == 0, np.uint32(1), version)
            self.changed[records] = True
        return records, Relocated()

    def mark(self) -> int:
        """From now on :meth:`entries_since` gives the rows written after this call."""
        with self.lock:
            self.changed = np.zeros(len(self.version), dtype=bool)
            return self.clears

    def entries_since(self, mark: int, chunk_records: int = 1 << 16):
        """As :meth:`entries`, for the rows written since the last :meth:`mark` (all of
        them after a :meth:`clear` since)."""
        records = np.flatnonzero(self.changed if mark == self.clears else self.version)
        yield from self._entries(records, chunk_records)

    def entries(self, chunk_records: int = 1 << 16):
        """Every stored ``(tables, ids, rows)``, a chunk at a time."""
        yield from self._entries(np.flatnonzero(self.version), chunk_records)

    def _entries(self, records: np.ndarray, chunk_records: int):
        for start in range(0, len(records), chunk_records):
            part = records[start : start + chunk_records]
            tables = np.searchsorted(self.base, part, side="right") - 1
            yield tables, part - self.base[tables], self._read(self.fd, part)

    def active_entries(self, mark: int | None = None, chunk_records: int = 1 << 16) -> Entries:
        """Every row (since ``mark``): none lies in a sealed segment."""
        return self.entries(chunk_records) if mark is None else self.entries_since(mark, chunk_records)

    def sealed(self, mark: int | None = None) -> Iterator[SealedSegment]:
        """None: rows are written in place, no file is ever sealed."""
        return iter(())

    def segment_entries(self, number: int, chunk_records: int = 1 << 16) -> Entries:
        """A KeyError: there are no segments (:meth:`sealed` yields none)."""
        raise KeyError(f"SSD tier of tables {self.table_names} has no segment {number}: its rows are stored "
                       f"in place in {self.path}")

    def can_adopt(self, record_bytes: int, records: int) -> bool:
        """False: rows of another store are loaded as rows (they belong at fixed records here)."""
        return False

    def adopt(self, path: Path, keys_path: Path, records: int, crc: int, keys: np.ndarray, take: np.ndarray,
              newest: np.ndarray | None = None) -> bool:
        """False, nothing changed: see :meth:`can_adopt`."""
        return False

    def clear(self) -> None:
        with self.lock:
            os.ftruncate(self.fd, 0)
            self.version = np.zeros_like(self.version)
            self.changed = np.zeros_like(self.changed)
            self.clears += 1
