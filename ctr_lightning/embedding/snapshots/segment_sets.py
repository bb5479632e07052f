"""Snapshot files that share the SSD log's sealed segments by hard link instead of copying rows.

A segment of the SSD log is never written again once sealed, so a snapshot can hold it by
a second name (a hard link: no bytes copied, the data stays on disk while either name
does) together with its keys file. A *segment set* file names the segments one rank's
table group shares: a header line of JSON (format, tables, row width, record size, and per
segment its file names, record count, CRC-32 and the keys file's SHA-256), then per segment
a bitmap of the records that belong to the snapshot (live when it was taken, and not
shadowed by a newer copy in memory). The segment set's own SHA-256 goes into the manifest.

Loading verifies every linked file against the set, then either adopts the segments into
an SSD log of the same record layout (hard links back, index rebuilt from the keys files:
no row read or written), or reads the records a chunk at a time (another layout, another
file system, export).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ctr_lightning.embedding.snapshots.row_files import RowFileError, file_sha256
from ctr_lightning.embedding.tiers.ssd.ssd_log_segments import HEADER_WORDS, KEY, record_keys
from ctr_lightning.embedding.tiers.ssd.ssd_log_snapshots import LINK_REFUSED
from ctr_lightning.embedding.tiers.ssd.ssd_tier import SealedSegment
from ctr_lightning.fault_points import reached

FORMAT = "ctr-lightning-segments-1"


@dataclass(frozen=True)
class SharedSegment:
    """One segment of a set: its file and keys file (names in the snapshot directory),
    record count, CRC-32 of the file, SHA-256 of the keys file, and which records belong
    (a bitmap, unpacked on demand: one segment's worth at a time)."""

    file: str
    keys: str
    records: int
    crc32: int
    keys_sha256: str
    bitmap: bytes
    newest: tuple[int, ...] | None = None  # per table, the newest last-lookup step of its records

    @property
    def take(self) -> np.ndarray:
        """bool [records]: the records that belong to the snapshot."""
        return np.unpackbits(np.frombuffer(self.bitmap, dtype=np.uint8), count=self.records).astype(bool)


@dataclass(frozen=True)
class SegmentSet:
    """A segment set file, read: tables, row width, record size and the segments."""

    path: Path
    tables: list[str]
    width: int
    record_bytes: int
    segments: list[SharedSegment]


class SegmentSetWriter:
    """Links sealed segments into a snapshot directory and writes the set naming them
    (as ``path.partial``, fsynced and renamed by :meth:`close`).

    Example::

        out = SegmentSetWriter(snapshot / "rank0-group0.segments", ["ads"], width=192, record_bytes=784)
        for sealed in log.sealed():
            out.add(sealed, sealed.live)
        out.close()      # out.size, out.sha256, out.rows_per_table, out.shared_bytes
    """

    def __init__(self, path: str | os.PathLike, table_names: list[str], width: int, record_bytes: int) -> None:
        self.path = Path(path)
        self.table_names, self.width, self.record_bytes = list(table_names), int(width), int(record_bytes)
        self.segments: list[dict] = []
        self._bitmaps: list[bytes] = []
        self.rows_per_table = [0] * len(self.table_names)
        self.size, self.sha256, self.shared_bytes = 0, "", 0
        self.refused = False

    def add(self, sealed: SealedSegment, take: np.ndarray) -> bool:
        """Share ``sealed`` with the records at ``take`` (a segment with none is left out).
        False where the file system refuses the link (two mounts of one file system, say):
        the caller writes those rows instead, and no segment is shared from then on."""
        if not take.any():
            return True
        if self.refused:
            return False
        stem = f"{self.path.stem}.{len(self.segments):06d}"
        names = (f"{stem}.seg", f"{stem}.keys")
        linked = []
        for source, name in zip((sealed.path, sealed.keys_path), names):
            try:
                os.link(source, self.path.parent / name)
                linked.append(self.path.parent / name)
            except OSError as e:
                for target in linked:
                    target.unlink(missing_ok=True)
                if e.errno in LINK_REFUSED:
                    self.refused = True
                    return False
                raise OSError(e.errno, f"linking {source} into the table snapshot as {self.path.parent / name}: "
                                       f"{e.strerror} (tables {self.table_names})") from e
        reached("snapshot_rows")
        self.segments.append({"file": names[0], "keys": names[1], "records": sealed.records, "crc32": sealed.crc,
                              "keys_sha256": hashlib.sha256(sealed.keys.tobytes()).hexdigest()})
        if sealed.newest is not None:  # so a run resumed from it deletes the segment whole once its rows are gone
            self.segments[-1]["newest"] = [int(x) for x in sealed.newest]
        self._bitmaps.append(np.packbits(take).tobytes())
        for t, n in zip(*np.unique(sealed.keys["table"][take], return_counts=True)):
            self.rows_per_table[int(t)] += int(n)
        self.shared_bytes += sealed.records * (self.record_bytes + KEY.itemsize)
        return True

    def close(self) -> None:
        header = json.dumps({"format": FORMAT, "tables": self.table_names, "width": self.width,
                             "record_bytes": self.record_bytes, "segments": self.segments}).encode() + b"\n"
        partial = self.path.with_name(self.path.name + ".partial")
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as f:
                for part in (header, *self._bitmaps):
                    f.write(part)
                    digest.update(part)
                    self.size += len(part)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            partial.unlink(missing_ok=True)
            raise OSError(e.errno, f"writing {partial}: {e.strerror} (disk full in {self.path.parent}?)") from e
        os.replace(partial, self.path)
        self.sha256 = digest.hexdigest()


def can_share(ssd_dir: str | os.PathLike, directory: str | os.PathLike) -> bool:
    """Whether files of ``ssd_dir`` can be hard-linked into ``directory`` (one file system)."""
    try:
        return os.stat(ssd_dir).st_dev == os.stat(directory).st_dev
    except OSError:
        return False


def read_segment_set(path: str | os.PathLike) -> SegmentSet:
    """The set's header and bitmaps; a damaged file raises a :class:`RowFileError` naming it."""
    path = Path(path)
    with open(path, "rb") as f:
        line = f.readline()
        try:
            header = json.loads(line)
            if header.get("format") != FORMAT:
                raise ValueError(header.get("format"))
            tables, width, record_bytes = list(header["tables"]), int(header["width"]), int(header["record_bytes"])
            segments = []
            for s in header["segments"]:
                bitmap = f.read((int(s["records"]) + 7) // 8)
                if len(bitmap) * 8 < int(s["records"]):
                    raise ValueError("cut short")
                segments.append(SharedSegment(s["file"], s["keys"], int(s["records"]), int(s["crc32"]),
                                              s["keys_sha256"], bitmap,
                                              tuple(int(x) for x in s["newest"]) if "newest" in s else None))
        except (ValueError, KeyError, TypeError) as e:
            raise RowFileError(f"{path}: not a segment set of {FORMAT}, or damaged ({e})") from e
    return SegmentSet(path, tables, width, record_bytes, segments)


def verify_segment_set(segment_set: SegmentSet) -> None:
    """Every linked file is there, of its size and checksum; else an error naming the file
    and the tables."""
    where, tables = segment_set.path.parent, segment_set.tables
    for s in segment_set.segments:
        for name, size in ((s.file, s.records * segment_set.record_bytes), (s.keys, s.records * KEY.itemsize)):
            path = where / name
            if not path.exists():
                raise RowFileError(f"table snapshot {where}: {name} (tables {tables}) is missing")
            if path.stat().st_size != size:
                raise RowFileError(f"table snapshot {where}: {name} (tables {tables}) has {path.stat().st_size} "
                                   f"bytes, its segment set says {size}")
        bad = (s.file if _crc32(where / s.file, tables) != s.crc32
               else s.keys if file_sha256(where / s.keys) != s.keys_sha256 else None)
        if bad is not None:
            raise RowFileError(f"table snapshot {where}: {bad} (tables {tables}) does not match its checksum in "
                               f"{segment_set.path.name}")


def segment_keys(segment_set: SegmentSet, segment: SharedSegment) -> np.ndarray:
    return np.fromfile(segment_set.path.parent / segment.keys, dtype=KEY)


def segment_rows(segment_set: SegmentSet, segment: SharedSegment, chunk_records: int = 1 << 16,
                 take: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
    """``(tables, ids, rows)`` of the records at ``take`` (default: those of the set),
    read a chunk of slots at a time."""
    take = segment.take if take is None else take
    keys = segment_keys(segment_set, segment)
    words = segment_set.record_bytes // 4
    path = segment_set.path.parent / segment.file
    with open(path, "rb") as f:
        for lo in range(0, segment.records, chunk_records):
            hi = min(lo + chunk_records, segment.records)
            wanted = np.flatnonzero(take[lo:hi])
            if not len(wanted):
                continue
            first, last = lo + int(wanted[0]), lo + int(wanted[-1]) + 1
            data = os.pread(f.fileno(), (last - first) * segment_set.record_bytes, first * segment_set.record_bytes)
            if len(data) != (last - first) * segment_set.record_bytes:
                raise RowFileError(f"{path}: cut short at record {first} (tables {segment_set.tables})")
            records = np.frombuffer(data, dtype=np.float32).reshape(last - first, words)[lo + wanted - first]
            tables, ids = record_keys(records)
            mine = keys[lo + wanted]
            if not (np.array_equal(ids, mine["id"]) and np.array_equal(tables, mine["table"])):
                raise RowFileError(f"{path}: records do not match {segment.keys} near record {first} "
                                   f"(tables {segment_set.tables})")
            yield tables, ids, torch.from_numpy(np.ascontiguousarray(records[:, HEADER_WORDS:]))


def segment_set_rows(path: str | os.PathLike, width: int | None = None,
                     chunk_records: int = 1 << 16) -> Iterator[tuple[list[str], np.ndarray, np.ndarray, torch.Tensor]]:
    """``(table_names, tables, ids, rows)`` of every row a segment set holds, a chunk at a time."""
    segment_set = read_segment_set(path)
    if width is not None and segment_set.width != width:
        raise RowFileError(f"{path}: rows of width {segment_set.width} (weights + optimizer state), expected {width}")
    for segment in segment_set.segments:
        for tables, ids, rows in segment_rows(segment_set, segment, chunk_records):
            yield segment_set.tables, tables, ids, rows


def _crc32(path: Path, tables: list[str], block: int = 8 << 20) -> int:
    crc = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(block):
                crc = zlib.crc32(chunk, crc)
    except OSError as e:
        raise OSError(e.errno or errno.EIO, f"reading {path} (tables {tables}): {e.strerror}") from e
    return crc
