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

_GROW_BYTES = 64 << 20


# Not cached on disk: numba cannot cache functions that call through ctypes pointers.
@numba.njit
def _read_records(fd, out, records) -> int:
    """pread one record per row into ``out``; returns the first failing row or -1."""
    nbytes = out.shape[1] * 4
    base = out.ctypes.data
    for i in range(len(records)):
        if _pread(fd, base + i * nbytes, nbytes, records[i] * nbytes) != nbytes:
            return i
    return -1


@numba.njit
def _write_records(fd, rows, records) -> int:
    nbytes = rows.shape[1] * 4
    base = rows.ctypes.data
    for i in range(len(records)):
        if _pwrite(fd, base + i * nbytes, nbytes, records[i] * nbytes) != nbytes:
            return i
    return -1


class SsdStore:
    """Rows of several tables as float32 records in ``<directory>/<name>.rows``.

    Records are read and written with one ``pread``/``pwrite`` each, in a compiled
    loop, so the tier costs page cache, not process memory. The (table, id) -> record
    index stays in DRAM (24 bytes a row at most, half-full). Space is reserved with
    ``posix_fallocate`` ahead of writing, so a full disk fails at once with ENOSPC
    instead of losing a write.

    Example::

        store = SsdStore("/nvme/run1", "dim64", width=192, table_names=["t0", "t1"])
        store.write(tables, ids, rows)          # float32 [n, 192]
        found, rows = store.read(tables, ids)
    """

    def __init__(self, directory: str | os.PathLike, name: str, width: int, table_names: list[str]) -> None:
        self.directory = Path(directory)
        self.width = width
        self.table_names = table_names
        self.record_bytes = width * 4
        self.fd = -1
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.path = self.directory / f"{name}.rows"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise OSError(e.errno, f"SSD tier of tables {table_names}: cannot create files in "
                                   f"{self.directory}: {e.strerror}") from e
        self.index = KeyIndex()
        self.records = 0
        self.reserved = 0

    def __len__(self) -> int:
        return self.records

    def _fail(self, action: str, err: int) -> OSError:
        return OSError(err, f"SSD tier of tables {self.table_names}: {action} {self.path} failed: "
                            f"{os.strerror(err)}; rows already written are intact")

    def _reserve(self, records: int) -> None:
        if records <= self.reserved:
            return
        want = max(records * self.record_bytes, self.reserved * self.record_bytes + _GROW_BYTES)
        try:
            os.posix_fallocate(self.fd, 0, want)
        except OSError as e:
            raise self._fail("reserving space in", e.errno) from e
        self.reserved = want // self.record_bytes

    def read(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(found mask, rows [found, width], records)`` for the rows stored here."""
        records = self.index.lookup(ids, tables)
        found = records >= 0
        records = records[found]
        order = np.argsort(records, kind="stable")  # ascending offsets read faster
        out = np.empty((len(records), self.width), dtype=np.float32)
        if len(records):
            sorted_out = np.empty_like(out)
            bad = _read_records(self.fd, sorted_out, records[order])
            if bad >= 0:
                raise self._fail("reading", errno.EIO)
            out[order] = sorted_out
        return found, out, records

    def write(self, tables: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store rows, overwriting earlier versions; new rows are appended."""
        if not len(ids):
            return
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        records = self.index.lookup(ids, tables)
        new = records < 0
        n_new = int(new.sum())
        self._reserve(self.records + n_new)
        records[new] = np.arange(self.records, self.records + n_new)
        bad = _write_records(self.fd, rows, records)
        if bad >= 0:
            # Repeat the failed write in Python to learn why (errno is not visible from numba).
            try:
                os.pwrite(self.fd, rows[bad].tobytes(), int(records[bad]) * self.record_bytes)
                err = errno.EIO
            except OSError as e:
                err = e.errno
            raise self._fail("writing", err)
        self.index.insert(ids[new], tables[new], records[new])
        self.records += n_new

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All stored ``(tables, ids, rows)``."""
        ids, tables, _ = self.index.items()
        _, rows, _ = self.read(tables, ids)
        return tables, ids, rows

    def clear(self) -> None:
        os.ftruncate(self.fd, 0)
        self.index.clear()
        self.records = self.reserved = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()
