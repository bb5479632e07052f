"""The Avazu CTR layout: a CSV ``id,click,hour,C1,banner_pos,...,C21``, with its header line or
without, and its test layout without ``click`` (scored, not trained on)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import numba
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from ctr_lightning.datamodules import field_decoders as fd
from ctr_lightning.datamodules.avazu_schema import AVAZU_COLUMNS, AVAZU_HEADERS, AVAZU_TEST_COLUMNS
from ctr_lightning.datamodules.row_index import UTF8_BOM
from ctr_lightning.datamodules.bad_lines import BadLineError
from ctr_lightning.datamodules.format_hints import format_hint
from ctr_lightning.datamodules.log_datamodule import LogDataModule
from ctr_lightning.datamodules.row_index import FileIndex, HeaderIf
from ctr_lightning.datamodules.sources import FileSlice, read_csv_slice, read_head
from ctr_lightning.datamodules.log_format import DecodedRows

AvazuHeader = bool | Literal["auto"]
_CATEGORICAL = AVAZU_COLUMNS[3:]
AVAZU_SPARSE = ("hour_of_day", "weekday", *_CATEGORICAL)


@numba.njit(cache=True)
def decode_hours(offsets, data, hour_of_day, weekday, bad) -> None:
    """``YYMMDDHH`` (20YY) to hour of day (0-23) and weekday (0 = Monday)."""
    for i in range(len(hour_of_day)):
        start = offsets[i]
        digits = np.zeros(8, dtype=np.int64)
        ok = offsets[i + 1] - start == 8
        if ok:
            for j in range(8):
                c = data[start + j]
                if c < 48 or c > 57:
                    ok = False
                    break
                digits[j] = c - 48
        year = 2000 + digits[0] * 10 + digits[1]
        month = digits[2] * 10 + digits[3]
        day = digits[4] * 10 + digits[5]
        hour = digits[6] * 10 + digits[7]
        if not ok or not (1 <= month <= 12 and 1 <= day <= 31 and hour <= 23):
            bad[i] = True
            hour_of_day[i] = 0
            weekday[i] = 0
            continue
        # Days since 1970-01-01 (a Thursday), by the civil-from-days inverse (H. Hinnant).
        y = year - 1 if month <= 2 else year
        era = y // 400
        yoe = y - era * 400
        doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
        doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
        days = era * 146097 + doe - 719468
        hour_of_day[i] = hour
        weekday[i] = (days + 3) % 7


class AvazuFormat:
    """Reads Avazu CSV logs: ``click`` is the label, ``id`` is dropped, ``hour`` becomes
    hour-of-day and weekday features, every other column is categorical (hashed bytes).

    There are no continuous features; batches carry a ``[B, 0]`` dense tensor. A
    ``group_column`` (for example ``device_ip``, Avazu's nearest to a user id) is also read
    as the batches' grouping column, for GAUC.

    ``header`` says whether a file's first line is the header: ``"auto"`` (default) takes
    it for one where it is exactly the Avazu header (or that of Avazu's test file) and
    reads every line of any other file as a record, in the standard column order;
    ``True`` requires the header, ``False`` reads every line as a record. Each file's
    columns are decided from its first line: 24 (or the training header) with ``click``;
    23 (or the test header) without, as Avazu's test file: its rows are scored with NaN
    labels by predict and refused by training.

    Example::

        fmt = AvazuFormat(header="auto")
        rows = fmt.decode(next(fmt.read(FileSlice("test.csv", header_lines=1), on_invalid_row=lambda r: "skip")))
    """

    num_fields = len(AVAZU_COLUMNS)  # of a labeled file; fields_of(path) is each file's
    delimiter = b","
    line_based = True
    sparse_feature_names = AVAZU_SPARSE
    num_dense_features = 0

    def __init__(self, block_size: int = 1 << 19, group_column: str | None = None,
                 header: AvazuHeader = "auto") -> None:
        if group_column is not None and group_column not in AVAZU_COLUMNS:
            raise ValueError(f"group_column {group_column!r} is not an Avazu column; they are {list(AVAZU_COLUMNS)}")
        if header not in (True, False, "auto"):
            raise ValueError(f"header must be True, False or 'auto', got {header!r}")
        self.block_size = block_size
        self.group_column = group_column
        self.header = header
        # The row index counts records after this many lines of each file, decided on its head.
        self.header_lines = HeaderIf(tuple(AVAZU_HEADERS)) if header == "auto" else int(header)
        self._convert = pacsv.ConvertOptions(column_types={c: pa.binary() for c in AVAZU_COLUMNS},
                                             strings_can_be_null=False)
        self._salts = [fd.feature_salt(f) for f in range(len(AVAZU_SPARSE))]
        self._columns: dict[str, tuple[str, ...]] = {}  # each file's, from check_file
        self.unlabeled_reason: str | None = None  # why the file being read has no labels

    def check_file(self, index: FileIndex) -> None:
        """Note the file's columns from its first line, or refuse a file that is no Avazu
        layout (checked once, when it is indexed, naming the reader that fits)."""
        first = index.head.split(b"\n", 1)[0].rstrip(b"\r")
        columns = _columns(index.head, index.header_lines) if index.head else AVAZU_COLUMNS  # empty: nothing to read
        if isinstance(columns, str):
            hint = format_hint(index.head, type(self).__name__)
            raise BadLineError(index.path, 1, columns + (f" ({hint})" if hint else ""),
                               first.decode("utf-8", "replace"))
        self._columns[index.path] = columns

    def fields_of(self, path: str) -> int:
        return len(self._file_columns(path))

    def _file_columns(self, path: str) -> tuple[str, ...]:
        if path not in self._columns:  # a file this format did not index (a FileSlice made by hand)
            head = read_head(path)
            header = self.header_lines if isinstance(self.header_lines, int) else self.header_lines(head)
            self.check_file(FileIndex(path, 0, "text", header, head=head))
        return self._columns[path]

    def read(self, fslice: FileSlice, on_invalid_row: Callable[[object], str]) -> Iterator[pa.RecordBatch]:
        columns = self._file_columns(fslice.path)
        self.unlabeled_reason = (None if "click" in columns else
                                 f"no click column (Avazu's test layout, {len(columns)} columns)")
        # The records only: a header line is not part of any slice.
        yield from read_csv_slice(fslice, columns, self._convert, on_invalid_row, self.block_size)

    def decode(self, batch: pa.RecordBatch) -> DecodedRows:
        n = batch.num_rows
        if "click" in batch.schema.names:
            labels, problems = fd.label_column(batch.column("click"), "click")
        else:  # the test layout: scored, never trained on (the stream refuses NaN labels there)
            labels, problems = np.full(n, np.nan, dtype=np.float32), []
        hour_of_day = np.empty(n, dtype=np.int64)
        weekday = np.empty(n, dtype=np.int64)
        bad = np.zeros(n, dtype=bool)
        decode_hours(*fd.column_buffers(batch.column("hour")), hour_of_day, weekday, bad)
        if bad.any():
            problems.append((bad, "hour is not YYMMDDHH"))
        ids = np.empty((len(AVAZU_SPARSE), n), dtype=np.int64)
        ids[0] = fd.hash_values(hour_of_day, self._salts[0])
        ids[1] = fd.hash_values(weekday, self._salts[1])
        for k, name in enumerate(_CATEGORICAL):
            fd.hash_bytes_ids(*fd.column_buffers(batch.column(name)), self._salts[2 + k], ids[2 + k])
        groups = None
        if self.group_column is not None:
            groups = np.empty(n, dtype=np.int64)
            fd.hash_bytes_ids(*fd.column_buffers(batch.column(self.group_column)), np.uint64(0), groups)
        return DecodedRows(labels=labels, dense=np.empty((n, 0), dtype=np.float32), ids=ids.T, problems=problems,
                           groups=groups)


class AvazuDataModule(LogDataModule):
    """Streams Avazu CTR logs (CSV, with its header line or without; ``.gz`` too; local or
    fsspec URLs).

    Arguments as :class:`LogDataModule`, plus the ones below. Avazu's test file, without
    ``click`` (23 columns), is read as ``predict_paths`` with empty labels; training on it
    is refused.

    Args:
        block_size: bytes parsed at a time.
        group_column: a column (e.g. ``"device_ip"``) whose values group the examples for
            GAUC (``val/gauc``).
        header: ``"auto"`` (default: a first line that is the Avazu header is one; any other
            file is read from its first line, in the standard column order), ``True`` (every
            file has it) or ``False`` (none has).

    Example::

        dm = AvazuDataModule(train_paths=["avazu/train.csv"], predict_paths=["avazu/test.csv"], batch_size=4096)
    """

    def __init__(self, block_size: int = 1 << 19, group_column: str | None = None, header: AvazuHeader = "auto",
                 **kwargs: Any) -> None:
        super().__init__(AvazuFormat(block_size=block_size, group_column=group_column, header=header), **kwargs)


def _columns(head: bytes, header_lines: int) -> tuple[str, ...] | str:
    """A file's columns from its head (its header, or the width most of its first lines
    have, so one damaged line does not decide the layout), or why it is no Avazu file."""
    lines = head.split(b"\n")
    first = lines[0].rstrip(b"\r").removeprefix(UTF8_BOM)
    if header_lines:
        return AVAZU_HEADERS.get(first) or (f"expected the Avazu header {','.join(AVAZU_COLUMNS)} (or its test "
                                            f"file's, without click)")
    complete = [line.rstrip(b"\r") for line in (lines[:-1] if len(lines) > 1 else lines) if line.strip()]
    widths = [line.count(b",") + 1 for line in complete] or [first.count(b",") + 1]
    for columns in (AVAZU_COLUMNS, AVAZU_TEST_COLUMNS):
        if 2 * widths.count(len(columns)) > len(widths):
            return columns
    return (f"expected the Avazu header id,click,hour,...,C21 or header-less Avazu lines of {len(AVAZU_COLUMNS)} "
            f"comma-separated fields ({len(AVAZU_TEST_COLUMNS)} without click, as in its test file); its first line "
            f"has {widths[0]}")
