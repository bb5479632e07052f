"""The Avazu CTR layout: a CSV with a header ``id,click,hour,C1,banner_pos,...,C21``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numba
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from ctr_lightning.datamodules import field_decoders as fd
from ctr_lightning.datamodules.bad_lines import BadLineError
from ctr_lightning.datamodules.format_hints import format_hint
from ctr_lightning.datamodules.log_datamodule import LogDataModule
from ctr_lightning.datamodules.row_index import FileIndex
from ctr_lightning.datamodules.sources import FileSlice, read_csv_slice
from ctr_lightning.datamodules.log_format import DecodedRows

AVAZU_COLUMNS = (
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
    "app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type",
    "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
)
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

    Example::

        fmt = AvazuFormat()
        rows = fmt.decode(next(fmt.read(FileSlice("train.csv"), on_invalid_row=lambda r: "skip")))
    """

    num_fields = len(AVAZU_COLUMNS)
    delimiter = b","
    line_based = True
    header_lines = 1
    sparse_feature_names = AVAZU_SPARSE
    num_dense_features = 0

    def __init__(self, block_size: int = 1 << 19, group_column: str | None = None) -> None:
        if group_column is not None and group_column not in AVAZU_COLUMNS:
            raise ValueError(f"group_column {group_column!r} is not an Avazu column; they are {list(AVAZU_COLUMNS)}")
        self.block_size = block_size
        self.group_column = group_column
        self._convert = pacsv.ConvertOptions(column_types={c: pa.binary() for c in AVAZU_COLUMNS},
                                             strings_can_be_null=False)
        self._salts = [fd.feature_salt(f) for f in range(len(AVAZU_SPARSE))]

    def check_file(self, index: FileIndex) -> None:
        """The file's first line must be the Avazu header (checked once, when it is indexed)."""
        if not index.head:
            return  # an empty file: no record, nothing to read
        header = index.head.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8", "replace")
        if header.split(",") != list(AVAZU_COLUMNS):
            hint = format_hint(index.head, type(self).__name__)
            raise BadLineError(index.path, 1, "expected the Avazu header " + ",".join(AVAZU_COLUMNS)
                               + (f" ({hint})" if hint else ""), header)

    def read(self, fslice: FileSlice, on_invalid_row: Callable[[object], str]) -> Iterator[pa.RecordBatch]:
        yield from read_csv_slice(fslice, AVAZU_COLUMNS, self._convert, on_invalid_row, self.block_size)

    def decode(self, batch: pa.RecordBatch) -> DecodedRows:
        n = batch.num_rows
        labels, problems = fd.label_column(batch.column(1), "click")
        hour_of_day = np.empty(n, dtype=np.int64)
        weekday = np.empty(n, dtype=np.int64)
        bad = np.zeros(n, dtype=bool)
        decode_hours(*fd.column_buffers(batch.column(2)), hour_of_day, weekday, bad)
        if bad.any():
            problems.append((bad, "hour is not YYMMDDHH"))
        ids = np.empty((len(AVAZU_SPARSE), n), dtype=np.int64)
        ids[0] = fd.hash_values(hour_of_day, self._salts[0])
        ids[1] = fd.hash_values(weekday, self._salts[1])
        for k, name in enumerate(_CATEGORICAL):
            fd.hash_bytes_ids(*fd.column_buffers(batch.column(3 + k)), self._salts[2 + k], ids[2 + k])
        groups = None
        if self.group_column is not None:
            groups = np.empty(n, dtype=np.int64)
            fd.hash_bytes_ids(*fd.column_buffers(batch.column(AVAZU_COLUMNS.index(self.group_column))),
                              np.uint64(0), groups)
        return DecodedRows(labels=labels, dense=np.empty((n, 0), dtype=np.float32), ids=ids.T, problems=problems,
                           groups=groups)


class AvazuDataModule(LogDataModule):
    """Streams Avazu CTR logs (CSV with header; ``.gz`` too; local or fsspec URLs).

    Arguments as :class:`LogDataModule`, plus ``block_size``: bytes parsed at a time, and
    ``group_column``: a column (e.g. ``"device_ip"``) whose values group the examples for
    GAUC (``val/gauc``).

    Example::

        dm = AvazuDataModule(train_paths=["avazu/train.csv"], batch_size=4096, num_workers=2)
    """

    def __init__(self, block_size: int = 1 << 19, group_column: str | None = None, **kwargs: Any) -> None:
        super().__init__(AvazuFormat(block_size=block_size, group_column=group_column), **kwargs)
