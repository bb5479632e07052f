"""Finding log files and cutting them into exact, disjoint shards for (rank, worker) readers."""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
from fsspec.core import url_to_fs
from fsspec.utils import infer_compression

_GLOB_CHARS = set("*?[")


def expand_paths(paths: str | Sequence[str], what: str = "data") -> list[str]:
    """Resolve files, directories and globs (local or any fsspec URL), sorted by name.

    Sorting by name makes a log partitioned by day or hour stream in time order.
    Raises ``FileNotFoundError`` naming the first path that matches nothing.
    """
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise ValueError(f"no {what} paths given")
    found: list[str] = []
    for path in paths:
        fs, root = url_to_fs(str(path))
        if _GLOB_CHARS & set(root):
            matches = [m for m in fs.glob(root) if fs.isfile(m)]
        elif fs.isdir(root):
            matches = [m for m in fs.find(root) if not m.rsplit("/", 1)[-1].startswith(".")]
        elif fs.isfile(root):
            matches = [root]
        else:
            matches = []
        if not matches:
            raise FileNotFoundError(f"{what} path {path!r} matches no file")
        found.extend(sorted(fs.unstrip_protocol(m) if "://" in str(path) else m for m in matches))
    return found


@dataclass(frozen=True)
class FileSlice:
    """The part of one file that one shard reads.

    Uncompressed files are cut into byte ranges; a line belongs to the range holding
    its first byte. Compressed files cannot be seeked, so every shard decodes the whole
    file and keeps record batches ``stripe, stripe + stripes, ...``.
    """

    path: str
    start: int = 0
    end: int | None = None
    stripe: int = 0
    stripes: int = 1

    @property
    def compressed(self) -> bool:
        return infer_compression(self.path) is not None

    def open(self) -> io.RawIOBase | io.BufferedIOBase:
        if self.compressed:
            return _SmallReads(fsspec.open(self.path, "rb", compression="infer").open())
        return _LineRange(fsspec.open(self.path, "rb").open(), self.start, self.end)


def plan_slices(paths: Sequence[str], shard: int, num_shards: int, line_based: bool = True) -> list[FileSlice]:
    """The slices of ``paths`` that shard ``shard`` of ``num_shards`` reads, in file order.

    Line-based files are cut by byte ranges; compressed and columnar ones by stripes.
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} outside [0, {num_shards})")
    slices = []
    for path in paths:
        if infer_compression(path) is not None or not line_based:
            slices.append(FileSlice(path, stripe=shard, stripes=num_shards))
            continue
        fs, root = url_to_fs(path)
        size = fs.size(root)
        start, end = size * shard // num_shards, size * (shard + 1) // num_shards
        if end > start:
            slices.append(FileSlice(path, start, end))
    return slices


class _SmallReads(io.RawIOBase):
    """Decompressed reads of at most 64 KiB that end quietly where the data breaks off.

    A truncated or corrupt stream then ends after its last whole piece, so every record
    before the damage is still parsed; the error is kept in :attr:`error` for the reader
    to report once the good part is through (see :func:`read_csv_blocks`).
    """

    def __init__(self, raw: io.IOBase, chunk: int = 1 << 16) -> None:
        self._raw = raw
        self._chunk = chunk
        self.error: Exception | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self.error is not None:
            return 0
        try:
            data = self._raw.read(min(len(buffer), self._chunk))
        except (EOFError, OSError, zlib.error) as e:
            self.error = e
            return 0
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._raw.close()
        super().close()


def line_boundary(f: io.IOBase, offset: int) -> int:
    """The first line start at or after byte ``offset`` of a seekable file."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    f.readline()
    return f.tell()


class _LineRange(io.RawIOBase):
    """A read-only view of the lines whose first byte lies in ``[start, end)``."""

    def __init__(self, raw: io.BufferedIOBase, start: int, end: int | None) -> None:
        self._raw = raw
        self.line_start = line_boundary(raw, start)
        self.line_end = line_boundary(raw, end) if end is not None else None
        raw.seek(self.line_start)
        self._pos = self.line_start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = len(buffer)
        if self.line_end is not None:
            want = min(want, self.line_end - self._pos)
        if want <= 0:
            return 0
        data = self._raw.read(want)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        self._raw.close()
        super().close()


def iter_lines(fslice: FileSlice) -> Iterator[tuple[int, bytes]]:
    """(1-based line number in the file, line without newline) for every line of a slice.

    Only used to name the line of a bad record, so its cost is paid on errors alone.
    """
    with fsspec.open(fslice.path, "rb", compression="infer") as f:
        line_no, start, end = 0, 0, None
        if not fslice.compressed:
            start = line_boundary(f, fslice.start)
            end = None if fslice.end is None else line_boundary(f, fslice.end)
            f.seek(0)
            remaining = start
            while remaining:
                chunk = f.read(min(remaining, 1 << 20))
                line_no += chunk.count(b"\n")
                remaining -= len(chunk)
        pos = start
        for line in f:
            if end is not None and pos >= end:
                return
            pos += len(line)
            line_no += 1
            yield line_no, line.rstrip(b"\r\n")


def line_blocks(f: io.RawIOBase | io.BufferedIOBase, block_size: int) -> Iterator[np.ndarray]:
    """The bytes of ``f`` in blocks of whole lines, each about ``block_size`` bytes.

    A block ends after its last newline (a line longer than a block spans several reads);
    the file's last line may lack its newline. The cut depends on the bytes alone, so
    every reader of a stream sees the same blocks. Raises the stream's kept error, as
    :func:`read_csv_blocks` does, once the readable part has been handed out.
    """
    tail = b""
    while True:
        buffer = bytearray(len(tail) + block_size)
        buffer[: len(tail)] = tail
        view, got = memoryview(buffer), len(tail)
        while got < len(buffer):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
        view.release()
        if got == len(tail):  # end of the stream
            if tail:
                yield np.frombuffer(bytes(tail), dtype=np.uint8)
            break
        cut = buffer.rfind(b"\n", 0, got) + 1
        if cut == 0:
            tail = bytes(buffer[:got])
            continue
        tail = bytes(buffer[cut:got])
        yield np.frombuffer(buffer, dtype=np.uint8, count=cut)
    error = getattr(f, "error", None)
    if error is not None:
        raise error


def read_csv_blocks(
    f: io.IOBase, read: pacsv.ReadOptions, parse: pacsv.ParseOptions, convert: pacsv.ConvertOptions
) -> Iterator[pa.RecordBatch]:
    """Record batches of a delimited file, block by block; an empty file yields none."""
    try:
        reader = pacsv.open_csv(f, read_options=read, parse_options=parse, convert_options=convert)
    except pa.ArrowInvalid as e:
        if "Empty CSV file" not in str(e):
            raise
        reader = iter(())  # nothing readable (the stream may still have broken off; see below)
    yield from reader
    error = getattr(f, "error", None)
    if error is not None:  # the stream broke off: the records before it are through, now say so
        raise error