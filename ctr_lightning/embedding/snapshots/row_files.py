"""Files of table rows for checkpoints, written and read a chunk at a time.

A file is a header line of JSON (format, table names, row width) and chunks. Each chunk is
a 24-byte head (magic, rows, payload bytes, CRC-32 of the payload), then the payload:
``table`` int32 ``[n]``, ``id`` int64 ``[n]`` and ``rows`` float32 ``[n, width]``. The
whole file's SHA-256 goes into the manifest that names it, so a file can be checked
before it is read, and a damaged chunk is named with its tables. Memory used either way
is one chunk.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ctr_lightning.fault_points import reached
from ctr_lightning.file_digest import file_sha256  # noqa: F401 - snapshots check their files with it

FORMAT = "ctr-lightning-rows-1"
_HEAD = struct.Struct("<4sQQI")  # magic, rows, payload bytes, CRC-32 of the payload
_MAGIC = b"ROWS"


class RowFileError(ValueError):
    """A row file that is damaged or not what its manifest says."""


class RowFileWriter:
    """Streams ``(tables, ids, rows)`` chunks into ``path``; :meth:`close` returns its size
    and SHA-256. Nothing is flushed to the final name until closed (written as
    ``path.partial``, then fsynced and renamed).

    Example::

        with RowFileWriter(path, ["ads", "users"], width=192) as out:
            out.write(tables, ids, rows)
        size, sha = out.size, out.sha256
    """

    def __init__(self, path: str | os.PathLike, table_names: list[str], width: int) -> None:
        self.path = Path(path)
        self.table_names, self.width = list(table_names), int(width)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self._partial, "wb")
        self._hash = hashlib.sha256()
        self.size = 0
        self.rows_per_table = [0] * len(self.table_names)
        self.sha256 = ""
        header = json.dumps({"format": FORMAT, "tables": self.table_names, "width": self.width}).encode() + b"\n"
        self._put(header)

    def _put(self, data: bytes | memoryview) -> None:
        try:
            self._file.write(data)
        except OSError as e:
            raise self._failed(e) from e
        self._hash.update(data)
        self.size += len(data)

    def _failed(self, e: OSError) -> OSError:
        # A full disk or a file-size limit: name the file and what was written so far.
        return OSError(e.errno, f"writing {self._partial}: {e.strerror} after {self.size} bytes "
                                f"(disk full, or a file size limit, in {self.path.parent}?)")

    def write(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor | np.ndarray) -> None:
        """Append rows: ``tables`` indexes :attr:`table_names`."""
        if not len(ids):
            return
        rows = rows.numpy() if isinstance(rows, torch.Tensor) else rows
        if rows.shape != (len(ids), self.width):
            raise ValueError(f"{self.path}: rows of shape {tuple(rows.shape)}, expected ({len(ids)}, {self.width})")
        parts = [np.ascontiguousarray(tables, dtype=np.int32).tobytes(),
                 np.ascontiguousarray(ids, dtype=np.int64).tobytes(),
                 np.ascontiguousarray(rows, dtype=np.float32).tobytes()]
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        self._put(_HEAD.pack(_MAGIC, len(ids), sum(len(p) for p in parts), crc))
        for part in parts:
            self._put(part)
            reached("snapshot_rows")
        for t, n in zip(*np.unique(tables, return_counts=True)):
            self.rows_per_table[int(t)] += int(n)

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        except OSError as e:
            failure = self._failed(e)
            self.abort()  # a full disk must not stay full of what was written so far
            raise failure from e
        os.replace(self._partial, self.path)
        self.sha256 = self._hash.hexdigest()

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # what is left unflushed is thrown away with the file
        self._partial.unlink(missing_ok=True)

    def __enter__(self) -> RowFileWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def read_row_file(path: str | os.PathLike, width: int | None = None) -> Iterator[tuple[list[str], np.ndarray,
                                                                                      np.ndarray, torch.Tensor]]:
    """``(table_names, tables, ids, rows)`` a chunk at a time; a damaged chunk raises a
    :class:`RowFileError` naming the file, the chunk's place and, where its table column
    still reads, its tables."""
    path = Path(path)
    with open(path, "rb") as f:
        line = f.readline()
        try:
            header = json.loads(line)
            names, file_width = list(header["tables"]), int(header["width"])
            if header.get("format") != FORMAT:
                raise ValueError(header.get("format"))
        except (ValueError, KeyError, TypeError) as e:
            raise RowFileError(f"{path}: not a row file of {FORMAT} (header {line[:80]!r})") from e
        if width is not None and file_width != width:
            raise RowFileError(f"{path}: rows of width {file_width} (weights + optimizer state), expected {width}")
        offset = len(line)
        while head := f.read(_HEAD.size):
            if len(head) < _HEAD.size:
                raise RowFileError(f"{path}: cut short at byte {offset} (tables {names})")
            magic, n, nbytes, crc = _HEAD.unpack(head)
            if magic != _MAGIC or nbytes != n * (4 + 8 + 4 * file_width):
                raise RowFileError(f"{path}: damaged chunk head at byte {offset} (tables {names})")
            payload = f.read(nbytes)
            if len(payload) < nbytes:
                raise RowFileError(f"{path}: cut short in the chunk at byte {offset} (tables {names})")
            tables = np.frombuffer(payload, dtype=np.int32, count=n).astype(np.int64)
            if zlib.crc32(payload) != crc:
                known = sorted({names[t] for t in np.unique(tables) if 0 <= t < len(names)})
                raise RowFileError(f"{path}: checksum mismatch in the chunk at byte {offset} of {n} rows of tables "
                                   f"{known or names}")
            ids = np.frombuffer(payload, dtype=np.int64, count=n, offset=4 * n).copy()
            rows = np.frombuffer(payload, dtype=np.float32, offset=12 * n).reshape(n, file_width)
            yield names, tables, ids, torch.from_numpy(rows.copy())
            offset += _HEAD.size + nbytes
