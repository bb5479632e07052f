"""How many records each log file holds, and where in it every 65,536th one starts.

Shards are cut by records, not bytes, so every (rank, worker) reads the same number of
examples whatever the files look like. The count costs one pass over a text file (or its
Parquet footer alone); it is kept in a small cache keyed by the file's path, size and
modification time, so later runs and the other ranks of a node read it instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs
from fsspec.utils import infer_compression

from ctr_lightning.datamodules.bad_lines import BadLineError
from ctr_lightning.datamodules.format_hints import format_hint
from ctr_lightning.datamodules.sources import MARK_EVERY, SmallReads

log = logging.getLogger(__name__)

_READ = 1 << 20
_HEAD = 1024  # bytes kept from the top of each file
_VERSION = 4  # 3: FileIndex.unreadable; 4: a byte order mark before a HeaderIf header
UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class HeaderIf:
    """One header line in a file whose first line is one of ``lines`` (a ``\\r`` before its
    newline aside), none in any other: for layouts whose files come with or without their
    header. Decided per file from its first bytes, as it is indexed.

    Example::

        rule = HeaderIf((b"id,click,hour",))
        rule(b"id,click,hour\\n1,0,14102100\\n"), rule(b"1,0,14102100\\n")   # (1, 0)
    """

    lines: tuple[bytes, ...]

    def __call__(self, head: bytes) -> int:
        # A UTF-8 byte order mark (spreadsheet exports write one) is no part of the header.
        return int(head.split(b"\n", 1)[0].rstrip(b"\r").removeprefix(UTF8_BOM) in self.lines)


# Lines at the top of every file that are not records: a number, or a rule on the file's head.
HeaderLines = int | HeaderIf


@dataclass(frozen=True)
class FileIndex:
    """The records of one file: lines after the header, or Parquet rows.

    ``marks[i]`` is the byte offset where record ``i * MARK_EVERY`` starts, for plain
    (uncompressed) text; compressed files are read from their start, Parquet files by
    row group (``groups``: rows per row group).
    ``unreadable`` says why a text file cannot be read to its end (a truncated or
    corrupt compressed stream, an I/O error; None: it can): ``records`` then counts the
    whole records before the break, and the readers' ``bad_files`` policy decides.
    An index with ``first`` > 0 or fewer ``records`` than its file holds is a part of it
    (records ``first .. first + records - 1``), as an event-time slice reads.

    Example::

        index = build_file_index("day_0.tsv", header_lines=0)
        index.records, index.marks[:2]     # 45_840_617, (0, 13_377_024)
    """

    path: str
    records: int
    kind: str  # "text", "compressed" or "parquet"
    header_lines: int = 0  # this file's, where the format's header is a rule (HeaderIf)
    marks: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()
    head: bytes = b""  # the file's first bytes (decompressed), to check a header or tell formats apart
    unreadable: str | None = None  # "EOFError: Compressed file ended ..." where reading broke off
    first: int = 0  # a part of the file (an event-time slice's): its records first .. first + records - 1


def build_file_index(path: str, header_lines: HeaderLines = 0, columnar: bool = False) -> FileIndex:
    """Count the records of ``path`` (one pass over a text file, the footer of a Parquet one)."""
    if columnar:
        with fsspec.open(path, "rb") as f:
            head = f.read(_HEAD)
            f.seek(0)
            try:
                metadata = pq.ParquetFile(f).metadata
            except (pa.ArrowInvalid, OSError) as e:
                hint = format_hint(head, "ParquetFormat")
                raise BadLineError(path, None, f"not a Parquet file ({e})" + (f". {hint}" if hint else "")) from e
            groups = tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
        return FileIndex(path, sum(groups), "parquet", groups=groups, head=head)
    compressed = infer_compression(path) is not None
    # In the reader's own pieces: a stream that breaks off then ends at the same byte.
    with SmallReads(fsspec.open(path, "rb", compression="infer").open()) as f:
        records, marks, head, header_lines = _count_lines(f, header_lines, keep_marks=not compressed)
        unreadable = f"{type(f.error).__name__}: {f.error}" if f.error is not None else None
    return FileIndex(path, records, "compressed" if compressed else "text", header_lines, tuple(marks), head=head,
                     unreadable=unreadable)


def _count_lines(f, header_lines: HeaderLines, keep_marks: bool) -> tuple[int, list[int], bytes, int]:
    """Records after ``header_lines`` lines, the byte offset of every MARK_EVERY-th, the head,
    and the header lines (a rule's, decided on the head).

    A last line without its newline is a record, unless the stream broke off there (a
    truncated gzip file): the count then ends at the last whole line before the break,
    as the reader's blocks do, so the break is known here, before any reader starts.
    """
    lines = 0  # newlines seen so far: line n starts right after the n-th newline
    position = 0  # bytes read so far
    marks: list[int] = []
    head = b""
    last = b"\n"
    while True:
        data = f.read(_READ)
        if not data:
            break
        if not head:
            head = data[:_HEAD]
            if not isinstance(header_lines, int):
                header_lines = header_lines(head)
            if keep_marks and header_lines == 0:
                marks.append(0)
        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
        if keep_marks and len(ends):
            records = lines + 1 + np.arange(len(ends)) - header_lines  # of the lines these newlines open
            keep = (records >= 0) & (records % MARK_EVERY == 0)
            marks.extend((position + ends[keep] + 1).tolist())
        lines += len(ends)
        position += len(data)
        last = data[-1:]
    unterminated = last != b"\n" and getattr(f, "error", None) is None  # a whole last line, not one cut off
    if not isinstance(header_lines, int):
        header_lines = header_lines(head)  # an empty file
    records = max(lines + unterminated - header_lines, 0)
    # An offset at the very end of the file (after the last newline) starts no record.
    return records, [m for m in marks if m < position], head, header_lines


class RowIndexCache:
    """File indexes on disk, keyed by path, size and modification time (so a changed file is
    counted again). Writes are atomic; an unwritable directory only costs the recount.

    Example::

        cache = RowIndexCache("~/.cache/ctr-lightning/row_index")
        index = cache.get("day_0.tsv", header_lines=0, columnar=False)
    """

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else None

    @staticmethod
    def key_of(path: str) -> str | None:
        """The file's identity in the cache: its path, size and modification time (None
        where it cannot be looked at)."""
        try:
            fs, root = url_to_fs(path)
            info = fs.info(root)
        except OSError:
            return None
        stamp = info.get("mtime") or info.get("LastModified") or info.get("ETag") or info.get("created")
        return json.dumps([path, info.get("size"), str(stamp)])

    def _key(self, path: str, header_lines: HeaderLines, columnar: bool) -> str | None:
        identity = self.key_of(path)
        if identity is None:
            return None
        rule = header_lines if isinstance(header_lines, int) else repr(header_lines)
        text = json.dumps([_VERSION, *json.loads(identity), rule, columnar, MARK_EVERY])
        return hashlib.sha1(text.encode()).hexdigest()

    def get(self, path: str, header_lines: HeaderLines = 0, columnar: bool = False) -> FileIndex:
        key = self._key(path, header_lines, columnar) if self.directory is not None else None
        if key is not None:
            cached = self.directory / f"{key}.json"
            try:
                state = json.loads(cached.read_text())
                return FileIndex(**{**state, "marks": tuple(state["marks"]), "groups": tuple(state["groups"]),
                                    "head": bytes.fromhex(state["head"])})
            except (OSError, ValueError, KeyError, TypeError):
                pass
        index = build_file_index(path, header_lines, columnar)
        if key is not None:
            self._put(key, index)
        return index

    def _put(self, key: str, index: FileIndex) -> None:
        state = {**asdict(index), "head": index.head.hex()}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f"{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(state))
            tmp.replace(self.directory / f"{key}.json")
        except OSError as e:
            log.warning("row index cache %s is not writable (%s); files are counted again next time",
                        self.directory, e)


def default_index_dir() -> str:
    """``$CTR_LIGHTNING_CACHE/row_index``, by default under ``~/.cache/ctr-lightning``."""
    return os.path.join(os.environ.get("CTR_LIGHTNING_CACHE", "~/.cache/ctr-lightning"), "row_index")


def index_files(paths: Sequence[str], header_lines: HeaderLines = 0, columnar: bool = False,
                cache_dir: str | None = None,
                check: Callable[[FileIndex], None] | None = None) -> list[FileIndex]:
    """The index of every file, from the cache where it holds one; ``check`` sees each."""
    cache = RowIndexCache(cache_dir)
    out = []
    for path in paths:
        index = cache.get(path, header_lines, columnar)
        if check is not None:
            check(index)
        out.append(index)
    return out
