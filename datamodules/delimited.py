"""Any delimited-text ad log (CSV, TSV, ...; plain or gzip) with the columns' roles named
by the user: by header name, or by 0-based position in files without a header."""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from ctr_lightning.datamodules import field_decoders as fd
from ctr_lightning.datamodules.bad_lines import BadLineError
from ctr_lightning.datamodules.format_hints import format_hint
from ctr_lightning.datamodules.log_datamodule import LogDataModule
from ctr_lightning.datamodules.log_format import DecodedRows, JaggedIds
from ctr_lightning.datamodules.row_index import UTF8_BOM, FileIndex
from ctr_lightning.datamodules.sources import FileSlice, read_csv_slice

Column = str | int  # a header name, or a 0-based position

# What pyarrow's CSV reader (so a file converted with it) reads as null: a dense value
# spelled so is missing, 0, as Parquet's null is.
_NULL_SPELLINGS = pa.array(["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                            "N/A", "NA", "NULL", "NaN", "n/a", "nan", "null"], pa.string())


@dataclass(frozen=True)
class _Layout:
    """Where each role's columns are in one file (0-based), and its width."""

    num_fields: int
    label: int | None
    dense: tuple[int, ...]
    categorical: tuple[int, ...]
    multi_hot: tuple[int, ...]
    group: int | None
    event_time: int | None
    unlabeled_reason: str | None  # why its rows have no label (no label column), else None

    @property
    def used(self) -> list[int]:
        roles = [self.label, *self.dense, *self.categorical, *self.multi_hot, self.group, self.event_time]
        return sorted({p for p in roles if p is not None})


class DelimitedFormat:
    """Reads delimited text logs whose columns' roles are named: a label, dense,
    categorical, multi-hot, group and event-time columns, by header name (``header=True``)
    or by 0-based position (``header=False``: ``3`` or ``"3"``).

    The values map as a Parquet file of the same rows does (as ``pyarrow.csv`` would
    convert it, read by :class:`ParquetFormat`), so the same data gives the same batches:
    a dense value is a float (empty, ``NA``, ``null``, ... are 0); a categorical value that
    is a decimal integer hashes as that number, any other as its bytes (empty too), with
    the feature's salt; a multi-hot value is a list split at ``multi_hot_separator`` (empty:
    an empty bag). Unlike Parquet, an empty categorical value in a column that is otherwise
    integers hashes as the empty string, not as an integer null. The label is 0 or 1
    (``0.0``/``1.0`` too); an empty label, or no label column, reads as unlabeled (NaN),
    which only ``predict_paths`` accept. An event time is integer POSIX seconds or a
    timestamp (``2026-12-01 05:00:00``, ISO 8601; one with a zone is read in UTC).

    Quoted fields may hold the delimiter (``"a,b"``), not a line break: a record is a line.
    Lines may end in CRLF. A line of another width than the file's header (or first line)
    is a bad line, as is a label not 0/1, a dense value that is no number and an event
    time that is no time. Each file's header is read on its own, so files may order their
    columns differently.

    Example::

        fmt = DelimitedFormat("click", dense_columns=["price"], categorical_columns=["ad_id", "site"],
                              multi_hot_columns=["interests"], multi_hot_separator="|")
    """

    line_based = True

    def __init__(
        self,
        label_column: Column | None = "label",
        dense_columns: Sequence[Column] = (),
        categorical_columns: Sequence[Column] = (),
        multi_hot_columns: Sequence[Column] = (),
        multi_hot_separator: str = "|",
        group_column: Column | None = None,
        event_time_column: Column | None = None,
        delimiter: str = ",",
        header: bool = True,
        quote_char: str | None = '"',
        num_fields: int | None = None,
        block_size: int = 1 << 19,
    ) -> None:
        if not categorical_columns and not multi_hot_columns:
            raise ValueError("DelimitedDataModule needs the columns whose ids it embeds: give categorical_columns "
                             "(one value a row) or multi_hot_columns (a list a row), or both")
        for name, char in (("delimiter", delimiter), ("multi_hot_separator", multi_hot_separator),
                           ("quote_char", quote_char)):
            if char is not None and (not isinstance(char, str) or len(char) != 1 or char in "\r\n"):
                raise ValueError(f"{name} must be one character (not a line break), got {char!r}")
        special = [delimiter, *([quote_char] if quote_char else []),
                   *([multi_hot_separator] if multi_hot_columns else [])]
        if len(set(special)) < len(special):
            raise ValueError(f"delimiter {delimiter!r}, quote_char {quote_char!r} and multi_hot_separator "
                             f"{multi_hot_separator!r} must differ")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_fields is not None and header:
            raise ValueError("num_fields is for files without a header (header=False); a header says it")
        roles = {"label_column": [label_column], "dense_columns": list(dense_columns),
                 "categorical_columns": list(categorical_columns), "multi_hot_columns": list(multi_hot_columns),
                 "group_column": [group_column], "event_time_column": [event_time_column]}
        for role, columns in roles.items():
            for c in columns:
                if c is None:
                    continue
                if isinstance(c, bool) or not isinstance(c, (str, int)):
                    raise TypeError(f"{role}: a column is a header name or a 0-based position, got {c!r}")
                if not header and _position(c) is None:
                    raise ValueError(f"{role}: header=False names columns by 0-based position (3 or \"3\"), "
                                     f"got {c!r}")
        self.label_column = label_column
        self.dense_columns = list(dense_columns)
        self.categorical_columns = list(categorical_columns)
        self.multi_hot_columns = list(multi_hot_columns)
        self.multi_hot_separator = multi_hot_separator
        self.group_column, self.event_time_column = group_column, event_time_column
        self.delimiter = delimiter.encode()
        self.header = header
        self.header_lines = 1 if header else 0
        self.quote_char = quote_char
        self.num_fields = num_fields or 0  # the width of a header-less file (0: that of its first line)
        self.block_size = block_size
        self.sparse_feature_names = tuple(str(c) for c in self.categorical_columns + self.multi_hot_columns)
        self.num_dense_features = len(self.dense_columns)
        self._salts = [fd.feature_salt(f) for f in range(len(self.sparse_feature_names))]
        self._layouts: dict[str, _Layout] = {}
        self._layout: _Layout | None = None  # of the file being read
        self.unlabeled_reason: str | None = None  # why the rows just decoded have no labels

    # -- each file's layout ----------------------------------------------------------------

    def check_file(self, index: FileIndex) -> None:
        """Find the roles' columns in the file's header (or first line), once, when it is indexed."""
        if index.head:
            self._layouts[index.path] = self._read_layout(index.path, index.head)

    def fields_of(self, path: str) -> int:
        """The width of every record of ``path``."""
        layout = self._layout_of(path)
        return layout.num_fields if layout is not None else self.num_fields

    def count_fields(self, line: bytes) -> int:
        """Fields of one line, quotes respected, as pyarrow's parser splits it."""
        return len(self._split(line))

    def _layout_of(self, path: str) -> _Layout | None:
        if path not in self._layouts:  # a reader given no checked index
            with fsspec.open(path, "rb", compression="infer") as f:
                head = f.readline()
            if not head:
                return None
            self._layouts[path] = self._read_layout(path, head)
        return self._layouts[path]

    def _split(self, line: bytes) -> list[str]:
        text = line.rstrip(b"\r\n").decode("utf-8", "replace")
        if self.quote_char is None:
            return text.split(self.delimiter.decode()) if text else []
        return next(csv.reader([text], delimiter=self.delimiter.decode(), quotechar=self.quote_char), [])

    def _read_layout(self, path: str, head: bytes) -> _Layout:
        if b"\n" not in head:  # a first line longer than the head the index keeps
            with fsspec.open(path, "rb", compression="infer") as f:
                head = f.readline()
        first = head.split(b"\n", 1)[0].removeprefix(UTF8_BOM)
        fields = self._split(first)
        width = len(fields) if self.header or not self.num_fields else self.num_fields
        names = fields if self.header else None
        missing: list[str] = []

        def find(column: Column | None, role: str) -> int | None:
            if column is None:
                return None
            position = column if isinstance(column, int) else _position(column) if not self.header else None
            if position is None:
                found = [i for i, name in enumerate(names) if name == column]
                if len(found) > 1:
                    raise BadLineError(path, 1, f"{role} {column!r} names columns {found} of its header", first)
                if not found:
                    missing.append(str(column))
                    return None
                position = found[0]
            if not 0 <= position < width:
                raise BadLineError(path, 1, f"{role} {column!r} is past its {width} fields", first)
            return position

        label = find(self.label_column, "label_column")
        label_missing = bool(missing)
        missing.clear()
        layout = _Layout(
            width, label, tuple(find(c, "dense column") for c in self.dense_columns),
            tuple(find(c, "categorical column") for c in self.categorical_columns),
            tuple(find(c, "multi-hot column") for c in self.multi_hot_columns), find(self.group_column, "group_column"),
            find(self.event_time_column, "event_time_column"),
            # A file without labels can still be scored: its labels read as NaN, which only
            # a predict pass accepts (LogStreamDataset refuses them elsewhere).
            (f"no label column {self.label_column!r}; its header has {names}" if label_missing
             else "label_column is None" if self.label_column is None else None))
        if missing:
            hint = format_hint(head, type(self).__name__)  # a Parquet file, a gzip one without .gz
            raise BadLineError(path, 1, f"no column {missing} in its header {names}" + (f". {hint}" if hint else ""))
        return layout

    # -- reading ---------------------------------------------------------------------------

    def read(self, fslice: FileSlice, on_invalid_row: Callable[[object], str]) -> Iterator[pa.RecordBatch]:
        layout = self._layout_of(fslice.path)
        if layout is None:
            return  # an empty file
        self._layout = layout
        used = [str(p) for p in layout.used]
        convert = pacsv.ConvertOptions(column_types={c: pa.binary() for c in used}, include_columns=used,
                                       strings_can_be_null=False)
        yield from read_csv_slice(fslice, [str(p) for p in range(layout.num_fields)], convert, on_invalid_row,
                                  self.block_size, self.delimiter.decode(),
                                  self.quote_char if self.quote_char is not None else False)

    def decode(self, batch: pa.RecordBatch) -> DecodedRows:
        layout, n = self._layout, batch.num_rows

        def column(position: int) -> pa.Array:
            return batch.column(str(position))

        problems: list[tuple[np.ndarray, str]] = []
        self.unlabeled_reason = layout.unlabeled_reason
        if layout.label is None:
            labels = np.full(n, np.nan, dtype=np.float32)
        else:
            labels, problems = _labels(column(layout.label), str(self.label_column))
            if np.isnan(labels).any():
                self.unlabeled_reason = f"empty labels in column {self.label_column!r}"
        dense = np.zeros((n, len(layout.dense)), dtype=np.float32)
        for j, position in enumerate(layout.dense):
            dense[:, j], bad = _dense_values(column(position))
            if bad.any():
                problems.append((bad, f"{self.dense_columns[j]} is not a number"))
        ids = np.empty((len(layout.categorical), n), dtype=np.int64)
        for k, position in enumerate(layout.categorical):
            fd.hash_text_ids(*fd.column_buffers(column(position)), self._salts[k], ids[k])
        separator = ord(self.multi_hot_separator)
        jagged = []
        for k, position in enumerate(layout.multi_hot):
            offsets, data = fd.column_buffers(column(position))
            lengths = np.empty(n, dtype=np.int32)
            fd.count_items(offsets, data, separator, lengths)
            values = np.empty(int(lengths.sum()), dtype=np.int64)
            fd.hash_item_ids(offsets, data, separator, self._salts[len(layout.categorical) + k], values)
            jagged.append(JaggedIds(lengths, values))
        groups = None
        if layout.group is not None:
            groups = np.empty(n, dtype=np.int64)
            fd.hash_text_ids(*fd.column_buffers(column(layout.group)), np.uint64(0), groups)
        event_time = None
        if layout.event_time is not None:
            event_time, missing, bad = _event_seconds(column(layout.event_time))
            name = self.event_time_column
            if missing.any():
                problems.append((missing, f"{name} (the event time) is missing"))
            if bad.any():
                problems.append((bad, f"{name} (the event time) is not POSIX seconds or a timestamp"))
        return DecodedRows(labels=labels, dense=dense, ids=ids.T, problems=problems, jagged=tuple(jagged),
                           groups=groups, event_time=event_time)

    def warm_up(self) -> None:
        """Load the compiled decoders here, so forked reader workers inherit them."""
        column = pa.array([b"1|a", b""], pa.binary())
        offsets, data = fd.column_buffers(column)
        fd.hash_text_ids(offsets, data, np.uint64(0), np.empty(2, dtype=np.int64))
        fd.count_items(offsets, data, ord("|"), np.empty(2, dtype=np.int32))
        fd.hash_item_ids(offsets, data, ord("|"), np.uint64(0), np.empty(2, dtype=np.int64))
        fd.label_column(column, "")
        fd.decode_integers(offsets, data, np.empty(2, dtype=np.int64), np.empty(2, dtype=bool))
        fd.decode_decimals(offsets, data, np.empty(2, dtype=np.float64), np.empty(2, dtype=np.int8))


def _position(column: Column) -> int | None:
    """The 0-based position a column is named by, or None for a header name."""
    if isinstance(column, int):
        return column
    return int(column) if column.isdigit() else None


def _labels(column: pa.Array, name: str) -> tuple[np.ndarray, list[tuple[np.ndarray, str]]]:
    """0/1 labels (NaN where empty), and the rows whose label is something else."""
    offsets, data = fd.column_buffers(column)
    labels = np.empty(len(column), dtype=np.float32)
    bad = np.zeros(len(column), dtype=bool)
    fd.decode_labels(offsets, data, labels, bad)
    if not bad.any():
        return labels, []
    empty = bad & (np.diff(offsets) == 0)
    labels[empty] = np.nan
    bad &= ~empty
    for i in np.flatnonzero(bad):  # rare: "1.0", as a float label column written out reads
        try:
            value = float(data[offsets[i] : offsets[i + 1]].tobytes())
        except ValueError:
            continue
        if value in (0.0, 1.0):
            labels[i], bad[i] = value, False
    return labels, [(bad, f"{name} is not 0 or 1")] if bad.any() else []


def _dense_values(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """float32 values of a text column (a missing value is 0), and which rows are no number.
    Plain decimals convert in one compiled pass (exactly as pyarrow would); the rest (null
    spellings, long numbers, bad text) through pyarrow."""
    offsets, data = fd.column_buffers(column)
    values = np.empty(len(column), dtype=np.float64)
    state = np.empty(len(column), dtype=np.int8)
    fd.decode_decimals(offsets, data, values, state)
    dense = values.astype(np.float32)  # through float64, as a Parquet column's cast to float32
    bad = np.zeros(len(column), dtype=bool)
    rest = np.flatnonzero(state == 2)
    if len(rest):
        dense[rest], bad[rest] = _arrow_dense_values(column.take(pa.array(rest)))
    return dense, bad


def _arrow_dense_values(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    text = column.view(pa.string())
    text = pc.if_else(pc.is_in(text, value_set=_NULL_SPELLINGS), pa.scalar(None, pa.string()), text)
    # Through float64, as pyarrow converts a text column to Parquet and ParquetFormat then to float32.
    numbers, bad = _cast_or_locate(text, lambda a: a.cast(pa.float64()), pa.float64())
    return pc.fill_null(numbers.cast(pa.float32()), 0.0).to_numpy(zero_copy_only=False), bad


def _event_seconds(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """POSIX seconds of integer or timestamp text, which rows are empty and which are no time."""
    offsets, data = fd.column_buffers(column)
    seconds = np.empty(len(column), dtype=np.int64)
    integer = np.empty(len(column), dtype=bool)
    fd.decode_integers(offsets, data, seconds, integer)
    empty = np.diff(offsets) == 0
    stamp = ~integer & ~empty
    bad = np.zeros(len(column), dtype=bool)
    if stamp.any():
        values, bad[stamp] = _cast_or_locate(column.view(pa.string()).filter(pa.array(stamp)), _timestamp_seconds,
                                             pa.int64())
        seconds[stamp] = pc.fill_null(values, 0).to_numpy(zero_copy_only=False)
    return seconds, empty, bad


def _timestamp_seconds(text: pa.Array) -> pa.Array:
    """Seconds of timestamp text; with a zone (``Z``, ``+01:00``) in UTC."""
    try:
        stamps = text.cast(pa.timestamp("ns"))
    except pa.ArrowInvalid:
        stamps = text.cast(pa.timestamp("ns", tz="UTC"))
    return stamps.cast(pa.timestamp("s"), safe=False).cast(pa.int64())


def _cast_or_locate(values: pa.Array, cast: Callable[[pa.Array], pa.Array],
                    to: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """``cast(values)``, with the values it refuses null and marked: halves are cast until
    the refused ones stand alone, so a few bad values cost a few casts, not one a row."""
    try:
        return cast(values), np.zeros(len(values), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        if len(values) == 1:
            return pa.nulls(1, to), np.ones(1, dtype=bool)
    half = len(values) // 2
    first, bad_first = _cast_or_locate(values.slice(0, half), cast, to)
    second, bad_second = _cast_or_locate(values.slice(half), cast, to)
    return pa.concat_arrays([first, second]), np.concatenate([bad_first, bad_second])


class DelimitedDataModule(LogDataModule):
    """Streams any delimited-text ad log (CSV, TSV, ...; plain or ``.gz``; files,
    directories, globs or fsspec URLs) with the columns' roles you name. Other arguments
    as :class:`LogDataModule`; see :class:`DelimitedFormat` for how values become features
    (as the same rows in Parquet would).

    Args:
        label_column: 0/1 clicks (a file without it, or empty labels, can only be predicted).
        dense_columns: numeric features, used as they are (empty is 0).
        categorical_columns: one value per row, hashed to ids.
        multi_hot_columns: lists per row, their items separated by ``multi_hot_separator``,
            hashed to ids in jagged bags.
        multi_hot_separator: between the items of a multi-hot field (one character).
        group_column: a user or query id per row, for GAUC (``val/gauc``).
        event_time_column: integer POSIX seconds or a timestamp per row (``Batch.event_time``);
            a row without one is a bad line.
        delimiter: between fields (``","``, ``"\\t"``, ``";"``, ...).
        header: the first line of every file names its columns, and columns are named by
            it; False: columns are named by 0-based position (``3`` or ``"3"``).
        quote_char: quotes a field that holds the delimiter (None: no quoting).
        num_fields: the width of header-less files (default: that of each file's first line).
        block_size: bytes parsed at a time.

    Example::

        dm = DelimitedDataModule(train_paths=["logs/2026-12-01.csv.gz"], label_column="click",
                                 dense_columns=["price"], categorical_columns=["ad_id", "site"],
                                 multi_hot_columns=["interests"], group_column="user_id")
        headerless = DelimitedDataModule(train_paths=["day_0.tsv"], delimiter="\\t", header=False,
                                         label_column=0, dense_columns=[1, 2], categorical_columns=[3, 4])
    """

    def __init__(
        self,
        label_column: str | int | None = "label",
        dense_columns: list[str | int] | None = None,
        categorical_columns: list[str | int] | None = None,
        multi_hot_columns: list[str | int] | None = None,
        multi_hot_separator: str = "|",
        group_column: str | int | None = None,
        event_time_column: str | int | None = None,
        delimiter: str = ",",
        header: bool = True,
        quote_char: str | None = '"',
        num_fields: int | None = None,
        block_size: int = 1 << 19,
        **kwargs: Any,
    ) -> None:
        log_format = DelimitedFormat(label_column, dense_columns or [], categorical_columns or [],
                                     multi_hot_columns or [], multi_hot_separator, group_column, event_time_column,
                                     delimiter, header, quote_char, num_fields, block_size)
        super().__init__(log_format, **kwargs)
