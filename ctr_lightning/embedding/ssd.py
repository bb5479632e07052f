"""The SSD tier: every row that left the memory tiers, in a file of fixed-size records."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
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


@numba.njit(cache=True, nogil=True)
def _runs(records):
    """Start indices of the runs of adjacent records (ascending input), plus the end."""
    starts = [0]
    for i in range(1, len(records)):
        if records[i] != records[i - 1] + 1:
            starts.append(i)
    starts.append(len(records))
    return np.array(starts, dtype=np.int64)


# Not cached on disk: numba cannot cache functions that call through ctypes pointers.
# nogil: a prefetch thread reads while the training thread computes.
@numba.njit(nogil=True)
def _transfer_records(fd, rows, records, write) -> int:
    """pwrite ``rows`` to (or pread them from) ``records`` (ascending), one call per run of
    adjacent records; returns the first row of a failed run, or -1."""
    nbytes = rows.shape[1] * 4
    base = rows.ctypes.data
    runs = _runs(records)
    for r in range(len(runs) - 1):
        i, j = runs[r], runs[r + 1]
        size = (j - i) * nbytes
        if write:
            done = _pwrite(fd, base + i * nbytes, size, records[i] * nbytes)
        else:
            done = _pread(fd, base + i * nbytes, size, records[i] * nbytes)
        if done != size:
            return i
    return -1


class RecordFile:
    """A file of fixed-size float32 records, read and written in compiled pread/pwrite loops.

    Writes are plain ``pwrite`` calls (not a memory map), so a full disk is an ENOSPC
    error right there; the tier costs page cache, not process memory. Subclasses decide
    where a (table, id) lives. (No posix_fallocate: on ext4, writing into reserved
    extents measured 4x slower here.)
    """

    def __init__(self, directory: str | os.PathLike, name: str, width: int, table_names: list[str]) -> None:
        self.directory = Path(directory)
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
        self.bytes_written = 0
        self.bytes_read = 0
        # Held while the layout changes (writes, compaction) and while a prefetch thread
        # locates rows; reading located records needs no lock (see :meth:`read_located`).
        self.lock = threading.Lock()

    def _fail(self, action: str, err: int) -> OSError:
        return OSError(err, f"SSD tier of tables {self.table_names}: {action} {self.path} failed: "
                            f"{os.strerror(err)}; rows already written are intact")

    def _read(self, fd: int, records: np.ndarray) -> np.ndarray:
        """Rows at ``records`` (any order), read in ascending runs."""
        out = np.empty((len(records), self.width), dtype=np.float32)
        if len(records):
            order = np.argsort(records, kind="stable")
            ordered = records[order]
            sorted_out = np.empty_like(out)
            if _transfer_records(fd, sorted_out, ordered, False) >= 0:
                raise self._fail("reading", errno.EIO)
            out[order] = sorted_out
            self.bytes_read += out.nbytes
        return out

    def read_located(self, records: np.ndarray, fd: int) -> np.ndarray:
        """Rows at ``records`` found by :meth:`locate`, read without the lock (by a prefetch
        thread). A concurrent write or compaction may make them stale or garbage: the
        tokens from :meth:`locate` tell, once compared with fresh ones."""
        return self._read(fd, records)

    def _write(self, fd: int, rows: np.ndarray, records: np.ndarray, action: str = "writing") -> None:
        """Rows to ``records`` (any order), written in ascending runs."""
        order = np.argsort(records, kind="stable")
        records = records[order]
        rows = np.ascontiguousarray(rows[order], dtype=np.float32)
        if _transfer_records(fd, rows, records, True) >= 0:
            # Repeat the write in Python to learn why (errno is not visible from numba).
            try:
                os.pwrite(fd, rows.tobytes(), int(records[0]) * self.record_bytes)
                err = errno.EIO
            except OSError as e:
                err = e.errno
            raise self._fail(action, err)
        self.bytes_written += rows.nbytes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class SsdStore(RecordFile):
    """Rows of tables with hashed (any 64-bit) ids, as a log of records.

    Every write appends the rows in one sequential ``pwrite`` and then points the
    (table, id) index at them, so a failed write leaves the old copies in force. When
    garbage outgrows the live rows, :meth:`compact` rewrites the live records to a fresh
    file, chunk by chunk, and swaps it in. The index stays in DRAM: 24 bytes a slot at
    most half full, so up to 48 bytes a stored row.

    Example::

        store = SsdStore("/nvme/run1", "dim64", width=192, table_names=["t0", "t1"])
        store.write(tables, ids, rows)          # float32 [n, 192]
        found, rows, _ = store.read(tables, ids)
    """

    def __init__(
        self, directory: str | os.PathLike, name: str, width: int, table_names: list[str],
        garbage_bytes: int = _GARBAGE_BYTES,
    ) -> None:
        super().__init__(directory, name, width, table_names)
        self.garbage_records = max(1, garbage_bytes // self.record_bytes)  # tolerated beyond 2x live
        self.index = KeyIndex()
        self.records = 0  # records in the log, live or not
        self.compactions = 0
        self._retired = -1

    def __len__(self) -> int:
        return len(self.index)

    def read(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(found mask, rows [found, width], records)`` for the rows stored here."""
        with self.lock:
            records = self.index.lookup(tables, ids)
            found = records >= 0
            return found, self._read(self.fd, records[found]), records[found]

    def locate(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """``(records, tokens, fd)``: where each row is (-1: not here), and a token that
        changes whenever its stored copy does (the log never rewrites a record in place,
        except by compaction, which the token counts)."""
        with self.lock:
            records = self.index.lookup(tables, ids)
            return records, np.where(records >= 0, records + (self.compactions << 40), -1), self.fd

    def write(self, tables: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store rows (unique (table, id) pairs), replacing earlier versions."""
        if not len(ids):
            return
        with self.lock:
            records = np.arange(self.records, self.records + len(ids), dtype=np.int64)
            self._write(self.fd, rows, records)
            self.index.insert(tables, ids, records)  # only now do readers see the new copies
            self.records += len(ids)
            if self.records > 2 * len(self.index) + self.garbage_records:
                self.compact()

    def compact(self, chunk_rows: int = 1 << 16) -> None:
        """Rewrite the live records into a new file and swap it in, ``chunk_rows`` at a time."""
        tables, ids, records = self.index.items()
        order = np.argsort(records, kind="stable")
        ids, tables, records = ids[order], tables[order], records[order]
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for start in range(0, len(ids), chunk_rows):
                part = records[start : start + chunk_rows]
                self._write(fd, self._read(self.fd, part), np.arange(start, start + len(part), dtype=np.int64),
                            "compacting")
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        # The old descriptor stays open for a prefetch thread that may still read it; its
        # rows are then stale by their tokens and dropped.
        if self._retired >= 0:
            os.close(self._retired)
        self._retired, self.fd = self.fd, fd
        self.index.insert(tables, ids, np.arange(len(ids), dtype=np.int64))
        self.records = len(ids)
        self.compactions += 1

    def close(self) -> None:
        if getattr(self, "_retired", -1) >= 0:
            os.close(self._retired)
            self._retired = -1
        super().close()

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All stored ``(tables, ids, rows)``."""
        tables, ids, _ = self.index.items()
        _, rows, _ = self.read(tables, ids)
        return tables, ids, rows

    def clear(self) -> None:
        with self.lock:
            os.ftruncate(self.fd, 0)
            self.index.clear()
            self.records = 0
            self.compactions += 1


class DirectSsdStore(RecordFile):
    """Rows of tables with bounded ids, each at a fixed record: table base + id.

    No index: one 32-bit version per possible row (0: never stored), in a calloc'ed
    array whose pages cost memory only where rows were stored, so DRAM use stays flat
    however large the tables grow. The file is sparse; rows are written in place, and
    each write bumps the row's version, which a prefetch thread's reads are checked by.

    Example::

        store = DirectSsdStore("/nvme/run1", "dim64", width=192, table_names=["t0"],
                               num_embeddings=[10**9])
    """

    def __init__(self, directory: str | os.PathLike, name: str, width: int, table_names: list[str],
                 num_embeddings: list[int]) -> None:
        super().__init__(directory, name, width, table_names)
        self.base = np.concatenate([[0], np.cumsum(num_embeddings)[:-1]]).astype(np.int64)
        self.version = np.zeros(int(np.sum(num_embeddings)), dtype=np.uint32)
        self.clears = 0

    def __len__(self) -> int:
        return int(np.count_nonzero(self.version))

    def read(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self.lock:
            records = self.base[tables] + ids
            found = self.version[records] > 0
            return found, self._read(self.fd, records[found]), records[found]

    def locate(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """As :meth:`SsdStore.locate`; the token is the row's version."""
        with self.lock:
            records = self.base[tables] + ids
            version = self.version[records].astype(np.int64)
            return (np.where(version > 0, records, -1), np.where(version > 0, version + (self.clears << 32), -1),
                    self.fd)

    def write(self, tables: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        if not len(ids):
            return
        records = self.base[tables] + ids
        with self.lock:
            self._write(self.fd, rows, records)
            # Bumped after the data: a read racing the write sees a new version later.
            version = self.version[records] + np.uint32(1)
            self.version[records] = np.where(version == 0, np.uint32(1), version)

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        records = np.flatnonzero(self.version)
        tables = np.searchsorted(self.base, records, side="right") - 1
        return tables, records - self.base[tables], self._read(self.fd, records)

    def clear(self) -> None:
        with self.lock:
            os.ftruncate(self.fd, 0)
            self.version = np.zeros_like(self.version)
            self.clears += 1
