"""Finding log files and cutting them into exact, disjoint shards for (rank, worker) readers."""

from __future__ import annotations

import datetime
import io
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
from fsspec.core import url_to_fs
from fsspec.utils import infer_compression


_GLOB_CHARS = set("*?[")
MARK_EVERY = 1 << 16  # records between two byte offsets a plain text file's index keeps


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


def time_slices(files: Sequence[str]) -> list[list[str]]:
    """The files grouped into time slices, in time order: one per Hive-style partition
    directory (``.../dt=2026-12-01/part-0.parquet``: the deepest ``key=value`` directory
    holding the file), or one per file where there is none.

    Example::

        time_slices(["logs/dt=2026-12-02/a", "logs/dt=2026-12-01/b", "logs/dt=2026-12-01/a"])
        # [["logs/dt=2026-12-01/a", "logs/dt=2026-12-01/b"], ["logs/dt=2026-12-02/a"]]
    """
    groups: dict[str, list[str]] = {}
    for path in files:
        parts = path.split("/")
        partition = max((i for i, p in enumerate(parts[:-1]) if "=" in p), default=None)
        key = "/".join(parts[: partition + 1]) if partition is not None else path
        groups.setdefault(key, []).append(path)
    return [sorted(groups[key]) for key in sorted(groups)]


_DATE_KEYS = ("dt", "date", "day", "ds")
_HOUR_KEYS = ("hour", "hh", "hr")


def slice_name(files: Sequence[str]) -> str:
    """A time slice's name: its Hive partition directory (``logs/dt=2026-12-01/hour=05``),
    or its one file."""
    parts = files[0].split("/")
    partition = max((i for i, p in enumerate(parts[:-1]) if "=" in p), default=None)
    return "/".join(parts[: partition + 1]) if partition is not None else files[0]


def slice_event_time(files: Sequence[str]) -> float | None:
    """The start of a time slice in POSIX seconds (UTC), from its Hive partitions: a date
    (``dt``, ``date``, ``day`` or ``ds``: ``2026-12-01`` or ``20261201``) and an optional
    ``hour``; None where the path has no date.

    Example::

        slice_event_time(["logs/dt=2026-12-01/hour=05/part-0.tsv"])   # 1796101200.0 (2026-12-01 05:00 UTC)
    """
    if not files:
        return None
    fields = dict(p.split("=", 1) for p in files[0].split("/")[:-1] if "=" in p)
    day = next((fields[k] for k in _DATE_KEYS if k in fields), None)
    if day is None:
        return None
    digits = day.replace("-", "")
    try:
        when = datetime.datetime.strptime(digits[:8], "%Y%m%d").replace(tzinfo=datetime.timezone.utc)
        hour = next((int(fields[k]) for k in _HOUR_KEYS if k in fields), 0)
    except ValueError:
        return None
    return (when + datetime.timedelta(hours=hour)).timestamp()


@dataclass(frozen=True)
class FileSlice:
    """Records ``[first, stop)`` of one file (``stop`` None: to the end): the lines after
    its ``header_lines``, or the rows of a Parquet file.

    A plain text file is entered at the byte offset its index keeps for every
    ``MARK_EVERY``-th record (``marks``), so a slice costs reading its own bytes and
    fewer than ``MARK_EVERY`` lines before each end; a compressed one is decoded from its
    start (it cannot be seeked) and the records before the slice are skipped.

    Example::

        with FileSlice("day_0.tsv", first=1000, stop=2000).open() as f:
            f.read()   # exactly lines 1001-2000 of the file
    """

    path: str
    first: int = 0
    stop: int | None = None
    header_lines: int = 0
    marks: tuple[int, ...] = ()

    @property
    def compressed(self) -> bool:
        return infer_compression(self.path) is not None

    def open(self) -> io.RawIOBase:
        """The bytes of exactly this slice's records, lines whole."""
        count = None if self.stop is None else self.stop - self.first
        if self.compressed or not self.marks:
            raw = SmallReads(fsspec.open(self.path, "rb", compression="infer").open())
            return _RecordRange(raw, skip=self.header_lines + self.first, count=count)
        raw = fsspec.open(self.path, "rb").open()
        start = _record_offset(raw, self.marks, self.first)
        end = None if self.stop is None else _record_offset(raw, self.marks, self.stop)
        return _ByteRange(raw, start, end)


def _record_offset(f: io.IOBase, marks: Sequence[int], record: int) -> int | None:
    """The byte offset where ``record`` starts in a plain text file (None: past its end)."""
    mark = record // MARK_EVERY
    if mark >= len(marks):
        return None  # the end of the file: the last mark's records run to it
    f.seek(marks[mark])
    return marks[mark] + _skip_lines(f, record - mark * MARK_EVERY)


def _skip_lines(f: io.IOBase, n: int) -> int:
    """Read past ``n`` whole lines of ``f``; returns the bytes read (fewer at its end)."""
    skipped = 0
    while n > 0:
        data = f.read(1 << 20)
        if not data:
            break
        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
        if len(ends) >= n:
            return skipped + int(ends[n - 1]) + 1
        n -= len(ends)
        skipped += len(data)
    return skipped


class SmallReads(io.RawIOBase):
    """Decompressed reads of at most 64 KiB that end quietly where the data breaks off.

    A truncated or corrupt stream then ends after its last whole piece, so every record
    before the damage is still parsed; the error is kept in :attr:`error` for the reader
    to report once the good part is through (see :func:`read_csv_slice`).
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


class _ByteRange(io.RawIOBase):
    """A read-only view of bytes ``[start, end)`` of a seekable file (``end`` None: its end)."""

    def __init__(self, raw: io.IOBase, start: int | None, end: int | None) -> None:
        self._raw = raw
        self._pos = start if start is not None else raw.seek(0, io.SEEK_END)
        self._end = end
        raw.seek(self._pos)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = len(buffer) if self._end is None else min(len(buffer), self._end - self._pos)
        if want <= 0:
            return 0
        data = self._raw.read(want)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _RecordRange(io.RawIOBase):
    """The lines of a stream after its first ``skip``: ``count`` of them (None: all).

    For streams that cannot seek (compressed files): lines are counted as they pass.
    A stream that breaks off keeps its error (see :class:`SmallReads`).
    """

    def __init__(self, raw: io.RawIOBase, skip: int, count: int | None) -> None:
        self._raw = raw
        self._skip = skip
        self._left = count  # newlines still to hand out; None: no limit
        self._pending = b""

    @property
    def error(self) -> Exception | None:
        return getattr(self._raw, "error", None)

    def readable(self) -> bool:
        return True

    def _fill(self) -> bytes:
        while not self._pending:
            data = self._raw.read(1 << 16)
            if not data:
                return b""
            if self._skip:
                ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
                if len(ends) < self._skip:
                    self._skip -= len(ends)
                    continue
                data = data[int(ends[self._skip - 1]) + 1 :]
                self._skip = 0
            self._pending = data
        return self._pending

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self._left == 0:
            return 0
        data = self._fill()
        if not data:
            return 0
        data = data[: len(buffer)]
        if self._left is not None:
            ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
            if len(ends) >= self._left:
                data = data[: int(ends[self._left - 1]) + 1]
                self._left = 0
            else:
                self._left -= len(ends)
        self._pending = self._pending[len(data) :]
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._raw.close()
        super().close()


def read_head(path: str, size: int = 1024) -> bytes:
    """The first ``size`` bytes of a file, decompressed (empty where it cannot be read:
    the reader that opens it next says why)."""
    try:
        with fsspec.open(path, "rb", compression="infer") as f:
            return f.read(size)
    except (EOFError, OSError, zlib.error):
        return b""


def iter_lines(fslice: FileSlice) -> Iterator[tuple[int, bytes]]:
    """(1-based line number in the file, line without newline) for every line of a slice.

    Only used to name the line of a bad record, so its cost is paid on errors alone.
    """
    number = fslice.header_lines + fslice.first
    with io.BufferedReader(fslice.open()) as f:
        for line in f:
            number += 1
            yield number, line.rstrip(b"\r\n")


def line_blocks(f: io.RawIOBase | io.BufferedIOBase, block_size: int) -> Iterator[np.ndarray]:
    """The bytes of ``f`` in blocks of whole lines, each about ``block_size`` bytes.

    A block ends after its last newline (a line longer than a block spans several reads);
    the file's last line may lack its newline. The cut depends on the bytes alone, so
    every reader of a stream sees the same blocks. Raises the stream's kept error, as
    :func:`read_csv_slice` does, once its whole lines have been handed out (the line the
    break cut off is part of that error, not a line of its own).
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
            if tail and getattr(f, "error", None) is None:  # (a stream that broke off cut its last line)
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


def read_csv_slice(
    fslice: FileSlice,
    column_names: Sequence[str],
    convert: pacsv.ConvertOptions,
    on_invalid_row: Callable[[object], str],
    block_size: int,
    delimiter: str = ",",
    quote_char: str | bool = False,
) -> Iterator[pa.RecordBatch]:
    """Record batches of a slice of a delimited file, about ``block_size`` bytes each; an
    empty slice yields none. The slice holds records only (header lines are no part of
    one), so every column is named here; a row of another width goes to ``on_invalid_row``.
    """
    read = pacsv.ReadOptions(column_names=list(column_names), block_size=block_size, use_threads=False)
    # Empty lines are kept, as rows of the wrong width: a record is a line, as the index counts them.
    parse = pacsv.ParseOptions(delimiter=delimiter, quote_char=quote_char, ignore_empty_lines=False,
                               invalid_row_handler=on_invalid_row)
    with fslice.open() as f:
        # Whole blocks: pyarrow takes each read as a block, and a compressed stream reads
        # in small pieces (SmallReads), which would cut blocks of a few hundred rows.
        blocks = io.BufferedReader(f, buffer_size=block_size)
        try:
            reader = pacsv.open_csv(blocks, read_options=read, parse_options=parse, convert_options=convert)
        except pa.ArrowInvalid as e:
            if "Empty CSV file" not in str(e):
                raise
            reader = iter(())  # nothing readable (the stream may still have broken off; see below)
        yield from reader
        error = getattr(f, "error", None)
        if error is not None:  # the stream broke off: the records before it are through, now say so
            raise error
