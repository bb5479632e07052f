"""Logs already in columnar form: Parquet files with a label, dense, categorical and
multi-hot (list) columns named by the user."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ctr_lightning.datamodules import field_decoders as fd
from ctr_lightning.datamodules.bad_lines import BadLineError
from ctr_lightning.datamodules.log_datamodule import LogDataModule
from ctr_lightning.datamodules.sources import FileSlice
from ctr_lightning.datamodules.log_format import DecodedRows, JaggedIds

# Integer categoricals that are null get this value, outside what a hashed id source uses.
_NULL_INT = np.iinfo(np.int64).min


def _categorical_ids(column: pa.Array, salt: np.uint64, where: str) -> np.ndarray:
    """Ids of an integer, string or binary column; nulls are a value of their own."""
    if pa.types.is_integer(column.type) or pa.types.is_boolean(column.type):
        values = pc.fill_null(column.cast(pa.int64()), _NULL_INT).to_numpy(zero_copy_only=False)
        return fd.hash_values(values, salt)
    if pa.types.is_string(column.type) or pa.types.is_binary(column.type) or pa.types.is_large_string(column.type):
        out = np.empty(len(column), dtype=np.int64)
        fd.hash_bytes_ids(*fd.column_buffers(column.cast(pa.binary())), salt, out)
        return out
    raise TypeError(f"{where}: categorical values must be integers or strings, got {column.type}")


def _event_seconds(column: pa.Array, where: str) -> tuple[np.ndarray, np.ndarray]:
    """POSIX seconds of an integer or timestamp column, and which rows have none."""
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.timestamp("s"), safe=False).cast(pa.int64())
    elif not pa.types.is_integer(column.type):
        raise TypeError(f"{where} must hold integer POSIX seconds or timestamps, got {column.type}")
    missing = column.is_null().to_numpy(zero_copy_only=False)
    return pc.fill_null(column.cast(pa.int64()), 0).to_numpy(zero_copy_only=False).astype(np.int64), missing


class ParquetFormat:
    """Reads row ranges of Parquet files (slices of row groups) into model arrays.

    Dense columns are used as they are (cast to float32; null is 0). Categorical
    columns (integers or strings) are hashed with their feature index to 63-bit ids.
    Multi-hot columns are lists of integers or strings and become jagged KJT bags (a null
    list is an empty bag). Bad rows (a null label, or one that is not 0/1) are named by
    their row number in the file; a file without the label column reads as unlabeled (NaN
    labels), which only ``predict_paths`` accept. A ``group_column`` (a user or query id, integers or
    strings) is read for GAUC, not as a feature; an ``event_time_column`` (integer POSIX
    seconds or a timestamp) gives each row its event time.

    Example::

        fmt = ParquetFormat("click", dense_columns=["price"], categorical_columns=["ad_id"],
                            multi_hot_columns=["interests"], group_column="user_id")
    """

    line_based = False
    header_lines = 0
    num_fields = 0
    delimiter = b""

    def __init__(
        self,
        label_column: str,
        dense_columns: Sequence[str] = (),
        categorical_columns: Sequence[str] = (),
        multi_hot_columns: Sequence[str] = (),
        group_column: str | None = None,
        event_time_column: str | None = None,
    ) -> None:
        if not categorical_columns and not multi_hot_columns:
            raise ValueError("ParquetDataModule needs the columns whose ids it embeds: give categorical_columns "
                             "(one value a row) or multi_hot_columns (a list a row), or both")
        self.label_column = label_column
        self.dense_columns = list(dense_columns)
        self.categorical_columns = list(categorical_columns)
        self.multi_hot_columns = list(multi_hot_columns)
        self.sparse_feature_names = tuple(self.categorical_columns + self.multi_hot_columns)
        self.num_dense_features = len(self.dense_columns)
        self.group_column = group_column
        self.columns = [label_column, *self.dense_columns, *self.sparse_feature_names]
        if group_column is not None and group_column not in self.columns:
            self.columns.append(group_column)
        self.event_time_column = event_time_column
        if event_time_column is not None and event_time_column not in self.columns:
            self.columns.append(event_time_column)
        self._salts = [fd.feature_salt(f) for f in range(len(self.sparse_feature_names))]
        self._path = ""
        self.unlabeled_reason: str | None = None  # why the file being read has no labels

    def read(self, fslice: FileSlice, on_invalid_row: Callable[[object], str]) -> Iterator[pa.RecordBatch]:
        self._path = fslice.path
        with fsspec.open(fslice.path, "rb") as f:
            try:
                pf = pq.ParquetFile(f)
            except pa.ArrowInvalid as e:
                raise BadLineError(fslice.path, None, f"not a Parquet file ({e})") from e
            missing = [c for c in self.columns if c not in pf.schema_arrow.names]
            # A file without labels can still be scored: its labels read as NaN, which only
            # a predict pass accepts (LogStreamDataset refuses them elsewhere).
            columns = [c for c in self.columns if c != self.label_column] if missing == [self.label_column] else None
            if missing and columns is None:
                raise BadLineError(fslice.path, None, f"missing columns {missing}; it has {pf.schema_arrow.names}")
            self.unlabeled_reason = (f"missing label column {self.label_column!r}; it has {pf.schema_arrow.names}"
                                     if columns else None)
            # The row groups that overlap the slice, each cut to it: one batch per piece.
            stop = pf.metadata.num_rows if fslice.stop is None else fslice.stop
            start = 0
            for group in range(pf.num_row_groups):
                rows = pf.metadata.row_group(group).num_rows
                lo, hi = max(fslice.first, start), min(stop, start + rows)
                if hi > lo:
                    table = pf.read_row_group(group, columns=columns or self.columns).slice(lo - start, hi - lo)
                    yield table.combine_chunks().to_batches()[0]
                start += rows
                if start >= stop:
                    break

    def decode(self, batch: pa.RecordBatch) -> DecodedRows:
        n = batch.num_rows
        if self.label_column in batch.schema.names:
            label = batch.column(self.label_column).cast(pa.float64())
            values = pc.fill_null(label, -1.0).to_numpy(zero_copy_only=False)
            bad = (values != 0.0) & (values != 1.0)
            problems = [(bad, f"{self.label_column} is not 0 or 1")] if bad.any() else []
        else:
            values, problems = np.full(n, np.nan), []
        dense = np.zeros((n, len(self.dense_columns)), dtype=np.float32)
        for j, name in enumerate(self.dense_columns):
            column = batch.column(name)
            if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
                raise TypeError(f"{self._path}: dense column {name!r} must be numeric, got {column.type}")
            dense[:, j] = pc.fill_null(column.cast(pa.float32()), 0.0).to_numpy(zero_copy_only=False)
        ids = np.empty((n, len(self.categorical_columns)), dtype=np.int64)
        for k, name in enumerate(self.categorical_columns):
            ids[:, k] = _categorical_ids(batch.column(name), self._salts[k], f"{self._path}: column {name!r}")
        jagged = []
        for k, name in enumerate(self.multi_hot_columns):
            column = batch.column(name)
            if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
                raise TypeError(f"{self._path}: multi-hot column {name!r} must be a list, got {column.type}")
            lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int32)
            flat = pc.list_flatten(column)
            salt = self._salts[len(self.categorical_columns) + k]
            jagged.append(JaggedIds(lengths, _categorical_ids(flat, salt, f"{self._path}: column {name!r}")))
        groups = None
        if self.group_column is not None:
            groups = _categorical_ids(batch.column(self.group_column), np.uint64(0),
                                      f"{self._path}: group column {self.group_column!r}")
        event_time = None
        if self.event_time_column is not None:
            event_time, missing = _event_seconds(batch.column(self.event_time_column),
                                                 f"{self._path}: event time column {self.event_time_column!r}")
            if missing.any():
                problems.append((missing, f"{self.event_time_column} (the event time) is missing"))
        return DecodedRows(labels=values.astype(np.float32), dense=dense, ids=ids, problems=problems,
                           jagged=tuple(jagged), groups=groups, event_time=event_time)


class ParquetDataModule(LogDataModule):
    """Streams Parquet logs with a schema you name (local files or fsspec URLs). Other
    arguments as :class:`LogDataModule`; row groups, not byte ranges, are what (rank,
    worker) shards divide.

    Args:
        label_column: 0/1 clicks.
        dense_columns: numeric features, used as they are.
        categorical_columns: one value per row (integers or strings), hashed to ids.
        multi_hot_columns: lists per row, hashed to ids in jagged bags.
        group_column: a user or query id per row: validation and test then report GAUC
            (``val/gauc``), the impression-weighted mean of the groups' AUCs.
        event_time_column: each row's event time, integer POSIX seconds or a timestamp,
            read into ``Batch.event_time`` (what ``Expiry(ttl="7d")`` counts in); a row
            without one is a bad row.

    Example::

        dm = ParquetDataModule(train_paths=["s3://logs/2026-12-01/"], label_column="click",
                               dense_columns=["price"], categorical_columns=["ad_id", "site"],
                               multi_hot_columns=["user_interests"])
    """

    def __init__(
        self,
        label_column: str = "label",
        dense_columns: list[str] | None = None,
        categorical_columns: list[str] | None = None,
        multi_hot_columns: list[str] | None = None,
        group_column: str | None = None,
        event_time_column: str | None = None,
        **kwargs: Any,
    ) -> None:
        log_format = ParquetFormat(label_column, dense_columns or [], categorical_columns or [], multi_hot_columns or [],
                                   group_column, event_time_column)
        super().__init__(log_format, **kwargs)
