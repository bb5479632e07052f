"""The SSD tier: every row that left the memory tiers, in a file of fixed-size records."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import numba
import numpy as np

from ctr_lightning.embedding.key_index import KeyIndex

_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread
_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
_pread.restype = ctypes.c_ssize_t
_pwrite = _libc.pwrite
_pwrite.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
_pwrite.restype = ctypes.c_ssize_t

_GARBAGE_BYTES = 64 << 20


# Not cached on disk: numba cannot cache functions that call through ctypes pointers.
@numba.njit
def _read_records(fd, out, records) -> int:
    """pread rows ``records`` (ascending) into ``out``, one call per run of adjacent
    records; returns the first row of a failed run or -1."""
    nbytes = out.shape[1] * 4
    base = out.ctypes.data
    i = 0
    n = len(records)
    while i < n:
        j = i + 1
        while j < n and records[j] == records[j - 1] + 1:
            j += 1
        length = (j - i) * nbytes
        if _pread(fd, base + i * nbytes, length, records[i] * nbytes) != length:
            return i
        i = j
    return -1


@numba.njit
def _write_records(fd, rows, records) -> int:
    """pwrite ``rows`` to ``records`` (ascending), one call per run of adjacent records."""
    nbytes = rows.shape[1] * 4
    base = rows.ctypes.data
    i = 0
    n = len(records)
    while i < n:
        j = i + 1
        while j < n and records[j] == records[j - 1] + 1:
            j += 1
        length = (j - i) * nbytes
        if _pwrite(fd, base + i * nbytes, length, records[i] * nbytes) != length:
            return i
        i = j
    return -1


class SsdStore:
    """Rows of several tables as float32 records in ``<directory>/<name>.rows``.

    The file is a log: every write appends the rows as one sequential ``pwrite`` and
    points the (table, id) index at the new records; the old copies become garbage.
    When garbage outgrows the live rows, :meth:`compact` rewrites the live records to a
    fresh file, chunk by chunk, and swaps it in. Reads are ``pread`` calls in a compiled
    loop (one per run of adjacent records), so the tier costs page cache, not process
    memory; the index stays in DRAM (at most 48 bytes a row). Writes are plain
    ``pwrite`` calls (not a memory map), so a full disk is an ENOSPC error right there,
    and the index moves to new records only after they are written: a failed write or
    compaction leaves every earlier row readable. (Space is not reserved with
    posix_fallocate: on ext4, writing into reserved extents was 4x slower here.)

    Example::

        store = SsdStore("/nvme/run1", "dim64", width=192, table_names=["t0", "t1"])
        store.write(tables, ids, rows)          # float32 [n, 192]
        found, rows, _ = store.read(tables, ids)
    """

    def __init__(
        self, directory: str | os.PathLike, name: str, width: int, table_names: list[str],
        garbage_bytes: int = _GARBAGE_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self.garbage_records = max(1, garbage_bytes // (width * 4))  # tolerated beyond 2x live
        self.width = width
        self.table_names = table_names
        self.record_bytes = width * 4
        self.fd = -1
        self.path = self.directory / f"{name}.rows"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise OSError(e.errno, f"SSD tier of tables {table_names}: cannot create files in "
                                   f"{self.directory}: {e.strerror}") from e
        self.index = KeyIndex()
        self.records = 0  # records in the log, live or not
        self.bytes_written = 0
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self.index)

    def _fail(self, action: str, err: int) -> OSError:
        return OSError(err, f"SSD tier of tables {self.table_names}: {action} {self.path} failed: "
                            f"{os.strerror(err)}; rows already written are intact")

    def read(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(found mask, rows [found, width], records)`` for the rows stored here."""
        records = self.index.lookup(ids, tables)
        found = records >= 0
        records = records[found]
        out = np.empty((len(records), self.width), dtype=np.float32)
        if len(records):
            order = np.argsort(records, kind="stable")  # ascending offsets, merged into runs
            sorted_out = np.empty_like(out)
            if _read_records(self.fd, sorted_out, records[order]) >= 0:
                raise self._fail("reading", errno.EIO)
            out[order] = sorted_out
            self.bytes_read += out.nbytes
        return found, out, records

    def write(self, tables: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store rows (unique (table, id) pairs), replacing earlier versions."""
        if not len(ids):
            return
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        records = np.arange(self.records, self.records + len(ids), dtype=np.int64)
        self._append(self.fd, rows, records, "writing")
        self.index.insert(ids, tables, records)  # only now do readers see the new copies
        self.records += len(ids)
        self.bytes_written += rows.nbytes
        if self.records > 2 * len(self.index) + self.garbage_records:
            self.compact()

    def _append(self, fd: int, rows: np.ndarray, records: np.ndarray, action: str) -> None:
        if _write_records(fd, rows, records) >= 0:
            # Repeat the write in Python to learn why (errno is not visible from numba).
            try:
                os.pwrite(fd, rows.tobytes(), int(records[0]) * self.record_bytes)
                err = errno.EIO
            except OSError as e:
                err = e.errno
            raise self._fail(action, err)

    def compact(self, chunk_rows: int = 1 << 16) -> None:
        """Rewrite the live records into a new file and swap it in, ``chunk_rows`` at a time."""
        ids, tables, records = self.index.items()
        order = np.argsort(records, kind="stable")
        ids, tables, records = ids[order], tables[order], records[order]
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for start in range(0, len(ids), chunk_rows):
                part = records[start : start + chunk_rows]
                rows = np.empty((len(part), self.width), dtype=np.float32)
                if _read_records(self.fd, rows, part) >= 0:
                    raise self._fail("reading", errno.EIO)
                self._append(fd, rows, np.arange(start, start + len(part), dtype=np.int64), "compacting")
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(self.fd)
        self.fd = fd
        self.index.insert(ids, tables, np.arange(len(ids), dtype=np.int64))
        self.records = len(ids)

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All stored ``(tables, ids, rows)``."""
        ids, tables, _ = self.index.items()
        _, rows, _ = self.read(tables, ids)
        return tables, ids, rows

    def clear(self) -> None:
        os.ftruncate(self.fd, 0)
        self.index.clear()
        self.records = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()
