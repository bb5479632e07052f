"""What an SSD tier does (:class:`SsdTier`), and what its two stores share.

The tiers above an SSD tier and the table snapshots speak to it only through
:class:`SsdTier`. Two stores implement it: :class:`ctr_lightning.embedding.tiers.ssd.ssd_log.SsdLog`
(hashed ids, a log of segment files a snapshot can hard-link) and
:class:`ctr_lightning.embedding.tiers.ssd.direct_store.DirectSsdStore` (bounded ids, a record per id).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ctr_lightning.embedding.tiers.key_index import dedup
from ctr_lightning.embedding.tiers.ssd.directory_lock import DirectoryLock

# What an SSD tier's counters read before it has done anything (and always, without one).
NO_SSD_COUNTERS = {"ssd_write_us": 0, "ssd_clean_us": 0, "index_grow_us": 0, "ssd_segments_cleaned": 0,
                   "ssd_records_moved": 0, "ssd_records_dropped": 0}

# Rows a chunk: (tables, ids, rows [n, width]).
Entries = Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass
class Relocated:
    """Rows whose SSD copy moved (written anew, or moved by a cleaning): memory tiers that
    hold a copy must learn the new record."""

    tables: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    locations: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @staticmethod
    def latest(parts: list[Relocated]) -> Relocated:
        """One entry a row, its latest location (later parts win)."""
        parts = [p for p in parts if len(p.ids)]
        if len(parts) <= 1:
            return parts[0] if parts else Relocated()
        tables, ids, locations = (np.concatenate(x) for x in zip(*((p.tables, p.ids, p.locations) for p in parts)))
        last = len(ids) - 1 - dedup(tables[::-1], ids[::-1])[0]
        return Relocated(tables[last], ids[last], locations[last])


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
    newest: np.ndarray | None = None  # per table, its records' newest last-lookup step (see Segment)


@runtime_checkable
class SsdTier(Protocol):
    """The SSD tier of a table group: rows (weights and optimizer state) by ``(table, id)``.

    A location names one stored copy of a row; a mark is an opaque point in the tier's
    history (:meth:`mark`), given back to :meth:`entries_since`. Stores whose rows lie in
    sealed segment files say so (:attr:`shares_segments`): a snapshot on the same file
    system then hard-links those files (:meth:`sealed`) and a load takes them back
    (:meth:`adopt`); the other stores yield no sealed segment and adopt none.

    Example::

        ssd: SsdTier = SsdLog("/nvme/run1", "dim64", width=192, table_names=["t0"])
        locations, moved = ssd.write(tables, ids, rows, old=np.full(len(ids), -1))
        found, rows, locations = ssd.read(tables, ids)
    """

    directory: Path
    record_bytes: int

    def __len__(self) -> int: ...

    @property
    def disk_bytes(self) -> int:
        """Bytes of its files on disk."""

    @property
    def live_bytes(self) -> int:
        """Bytes of the rows it holds."""

    @property
    def index_bytes(self) -> int:
        """DRAM it holds to find rows."""

    @property
    def shares_segments(self) -> bool:
        """Whether its rows lie in sealed segment files a snapshot can hard-link."""

    def counters(self) -> dict[str, int]:
        """Microseconds and counts so far, the keys of :data:`NO_SSD_COUNTERS`."""

    def read(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(found mask, rows [found, width], locations [found])``."""

    def may_hold(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """A mask of the keys it may hold: false only for keys it does not (no read)."""

    def write(self, tables: np.ndarray, ids: np.ndarray, rows: np.ndarray,
              old: np.ndarray) -> tuple[np.ndarray, Relocated]:
        """Store rows (unique keys), ``old`` each row's current location (-1: none): their
        new locations, and the rows whose location moved meanwhile."""

    def locate(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """``(locations, tokens, pinned)`` for a prefetch thread, pinned until :meth:`release`."""

    def tokens(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The tokens :meth:`locate` would give (a token changes whenever the row does)."""

    def read_located(self, tables: np.ndarray, ids: np.ndarray, locations: np.ndarray,
                     pinned: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """``(ok, rows)`` at located records, without the lock."""

    def release(self, pinned: dict[int, int]) -> None:
        """Unpin what :meth:`locate` pinned."""

    def mark(self) -> Any:
        """Where the tier stands now, for :meth:`entries_since` and :meth:`sealed`."""

    def entries(self, chunk_records: int = 1 << 16) -> Entries:
        """Every stored row, a chunk at a time."""

    def entries_since(self, mark: Any, chunk_records: int = 1 << 16) -> Entries:
        """A superset of the rows written since ``mark``, a chunk at a time."""

    def sealed(self, mark: Any = None) -> Iterator[SealedSegment]:
        """The sealed segment files (since ``mark``), made durable; none where it has none."""

    def active_entries(self, mark: Any = None, chunk_records: int = 1 << 16) -> Entries:
        """The rows (since ``mark``) not in :meth:`sealed`'s segments."""

    def segment_entries(self, number: int, chunk_records: int = 1 << 16) -> Entries:
        """The rows of one of :meth:`sealed`'s segments."""

    def can_adopt(self, record_bytes: int, records: int) -> bool:
        """Whether a sealed segment of these dimensions could become one of its own."""

    def adopt(self, path: Path, keys_path: Path, records: int, crc: int, keys: np.ndarray, take: np.ndarray,
              newest: np.ndarray | None = None) -> bool:
        """Take a sealed segment by hard link, its records at ``take`` live (``newest``: per
        table its records' newest last-lookup step, where known); False, with nothing
        changed, where it cannot."""

    def clear(self) -> None:
        """Forget every row."""

    def close(self) -> None:
        """Close its files and give up its directory."""


def claim_directory(directory: Path, table_names: list[str]) -> DirectoryLock:
    """This process's claim on an SSD directory, created if need be: another run's tiers
    there are refused. Taken before a store truncates or deletes anything there, as the
    files of another live run are not stale."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"SSD tier of tables {table_names}: cannot create files in "
                               f"{directory}: {e.strerror}") from e
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
