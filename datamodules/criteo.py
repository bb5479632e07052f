"""The Criteo raw layout (Kaggle and 1TB "day_N" files): ``label, I1..I13, C1..C26``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from ctr_lightning.hashing import feature_ids
from ctr_lightning.datamodules.log_datamodule import LogDataModule
from ctr_lightning.datamodules.sources import FileSlice
from ctr_lightning.datamodules.stream import DecodedRows
from ctr_lightning.datamodules.synthetic_criteo import DENSE_NAMES, SPARSE_NAMES

_HEX_LUT = np.full(256, -1, dtype=np.int16)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_HEX_WEIGHTS = (np.uint64(16) ** np.arange(7, -1, -1, dtype=np.uint64)).astype(np.uint64)
# Outside the 32-bit value range, so "missing" gets its own id in every feature.
MISSING_VALUE = np.uint64(1 << 32)
_INT_PATTERN = r"^[+-]?[0-9]{1,18}$"


def decode_hex32(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode an Arrow string column of 8-hex-digit values.

    Returns ``(values uint64, missing, bad)``: missing for null or empty fields, bad
    for anything that is not exactly 8 hex digits.
    """
    column = column.cast(pa.string()) if column.type != pa.string() else column
    n = len(column)
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=n + 1, offset=column.offset * 4)
    lengths = np.diff(offsets)
    missing = lengths == 0
    if column.null_count:
        missing |= np.asarray(column.is_null())
    full = lengths == 8
    bad = ~(missing | full)
    values = np.full(n, MISSING_VALUE, dtype=np.uint64)
    if full.any():
        data = np.frombuffer(data_buf, dtype=np.uint8)
        if full.all():
            chars = data[offsets[0] : offsets[0] + 8 * n].reshape(n, 8)
        else:
            chars = data[offsets[:-1][full][:, None] + np.arange(8)]
        nibbles = _HEX_LUT[chars]
        not_hex = (nibbles < 0).any(axis=1)
        decoded = (nibbles.astype(np.uint64) * _HEX_WEIGHTS).sum(axis=1, dtype=np.uint64)
        values[full] = np.where(not_hex, MISSING_VALUE, decoded)
        bad[np.flatnonzero(full)[not_hex]] = True
    return values, missing, bad


def decode_counts(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Parse an Arrow string column of integer counts: ``(int64 values, 0 where null), bad``."""
    try:
        values = pc.cast(column, pa.int64())
        bad = np.zeros(len(column), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        valid = pc.fill_null(pc.match_substring_regex(column, _INT_PATTERN), True)
        bad = ~np.asarray(valid)
        values = pc.cast(pc.if_else(valid, column, pa.scalar(None, pa.string())), pa.int64())
    return np.asarray(pc.fill_null(values, 0)), bad


class CriteoFormat:
    """Reads the Criteo raw TSV layout and turns it into model-ready arrays.

    Counts become ``log(1 + max(x, 0))`` with missing as 0; each categorical value is
    hashed with its feature index to a 63-bit id (missing gets an id of its own).

    Example::

        fmt = CriteoFormat()
        for record_batch in fmt.read(FileSlice("day_0.tsv"), on_invalid_row=lambda r: "skip"):
            rows = fmt.decode(record_batch)
    """

    num_fields = 1 + len(DENSE_NAMES) + len(SPARSE_NAMES)
    delimiter = b"\t"
    sparse_feature_names = SPARSE_NAMES
    num_dense_features = len(DENSE_NAMES)

    def __init__(self, block_size: int = 1 << 22) -> None:
        self.block_size = block_size
        names = ["label", *DENSE_NAMES, *SPARSE_NAMES]
        self._read_options = pacsv.ReadOptions(column_names=names, block_size=block_size, use_threads=False)
        self._convert_options = pacsv.ConvertOptions(
            column_types={name: pa.string() for name in names},
            strings_can_be_null=True,
            null_values=[""],
        )

    def read(self, fslice: FileSlice, on_invalid_row: Callable[[object], str]) -> Iterator[pa.RecordBatch]:
        parse = pacsv.ParseOptions(
            delimiter="\t", quote_char=False, ignore_empty_lines=False, invalid_row_handler=on_invalid_row)
        with fslice.open() as f:
            try:
                reader = pacsv.open_csv(f, read_options=self._read_options, parse_options=parse,
                                        convert_options=self._convert_options)
            except pa.ArrowInvalid as e:
                if "Empty CSV file" in str(e):
                    return
                raise
            yield from reader

    def decode(self, batch: pa.RecordBatch) -> DecodedRows:
        problems: list[tuple[np.ndarray, str]] = []
        label = batch.column(0)
        is_one = np.asarray(pc.fill_null(pc.equal(label, "1"), False))
        is_zero = np.asarray(pc.fill_null(pc.equal(label, "0"), False))
        problems.append((~(is_one | is_zero), "label is not 0 or 1"))
        dense = np.empty((batch.num_rows, len(DENSE_NAMES)), dtype=np.float32)
        for j, name in enumerate(DENSE_NAMES):
            counts, bad = decode_counts(batch.column(1 + j))
            dense[:, j] = np.log1p(np.maximum(counts, 0))
            if bad.any():
                problems.append((bad, f"{name} is not an integer"))
        ids = np.empty((batch.num_rows, len(SPARSE_NAMES)), dtype=np.int64)
        for f, name in enumerate(SPARSE_NAMES):
            values, _, bad = decode_hex32(batch.column(1 + len(DENSE_NAMES) + f))
            ids[:, f] = feature_ids(values, f)
            if bad.any():
                problems.append((bad, f"{name} is not 8 hex digits"))
        return DecodedRows(labels=is_one.astype(np.float32), dense=dense, ids=ids, problems=problems)


class CriteoDataModule(LogDataModule):
    """Streams Criteo-layout logs (``.tsv``, ``.gz``, local or fsspec URLs).

    Args:
        train_paths: files, directories or globs for training, read in name order.
        val_paths: held-out files (train and validation are split by file).
        test_paths: files for ``trainer.test``.
        predict_paths: files for ``trainer.predict``.
        batch_size: examples per batch.
        num_workers: DataLoader worker processes per rank.
        bad_lines: ``"skip"`` (count and log) or ``"raise"`` (stop with file:line).
        block_size: bytes pyarrow parses at a time.

    Example::

        dm = CriteoDataModule(train_paths=["day_0.gz"], val_paths=["day_1.gz"], batch_size=4096)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))   # ctr_lightning.Batch
    """

    def __init__(
        self,
        train_paths: list[str] | str | None = None,
        val_paths: list[str] | str | None = None,
        test_paths: list[str] | str | None = None,
        predict_paths: list[str] | str | None = None,
        batch_size: int = 4096,
        num_workers: int = 0,
        bad_lines: str = "skip",
        block_size: int = 1 << 22,
    ) -> None:
        super().__init__(
            log_format=CriteoFormat(block_size=block_size),
            train_paths=train_paths,
            val_paths=val_paths,
            test_paths=test_paths,
            predict_paths=predict_paths,
            batch_size=batch_size,
            num_workers=num_workers,
            bad_lines=bad_lines,
        )
