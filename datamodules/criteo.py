"""The Criteo raw layout (Kaggle and 1TB "day_N" files): ``label, I1..I13, C1..C26``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from ctr_lightning.datamodules import field_decoders as fd
from ctr_lightning.datamodules.log_datamodule import LogDataModule
from ctr_lightning.datamodules.sources import FileSlice, read_csv_blocks
from ctr_lightning.datamodules.stream import DecodedRows
from ctr_lightning.datamodules.synthetic_criteo import DENSE_NAMES, SPARSE_NAMES

class CriteoFormat:
    """Reads the Criteo raw TSV layout and turns it into model-ready arrays.

    Counts become ``log(1 + max(x, 0))`` with missing as 0; each categorical value is
    hashed with its feature index to a 63-bit id (missing gets an id of its own).
    ``negative_counts="bad"`` makes a negative count a bad line instead of a 0.

    Example::

        fmt = CriteoFormat()
        for record_batch in fmt.read(FileSlice("day_0.tsv"), on_invalid_row=lambda r: "skip"):
            rows = fmt.decode(record_batch)
    """

    num_fields = 1 + len(DENSE_NAMES) + len(SPARSE_NAMES)
    delimiter = b"\t"
    line_based = True
    header_lines = 0
    sparse_feature_names = SPARSE_NAMES
    num_dense_features = len(DENSE_NAMES)

    def __init__(self, block_size: int = 1 << 19, negative_counts: str = "clamp") -> None:
        if negative_counts not in ("clamp", "bad"):
            raise ValueError(f"negative_counts must be 'clamp' or 'bad', got {negative_counts!r}")
        self.block_size = block_size
        self.negative_is_bad = negative_counts == "bad"
        names = ["label", *DENSE_NAMES, *SPARSE_NAMES]
        self._read_options = pacsv.ReadOptions(column_names=names, block_size=block_size, use_threads=False)
        # Binary columns skip UTF-8 validation; the compiled decoders check every byte anyway.
        self._convert_options = pacsv.ConvertOptions(
            column_types={name: pa.binary() for name in names}, strings_can_be_null=False)
        self._salts = [fd.feature_salt(f) for f in range(len(SPARSE_NAMES))]

    def read(self, fslice: FileSlice, on_invalid_row: Callable[[object], str]) -> Iterator[pa.RecordBatch]:
        parse = pacsv.ParseOptions(
            delimiter="\t", quote_char=False, ignore_empty_lines=False, invalid_row_handler=on_invalid_row)
        with fslice.open() as f:
            yield from read_csv_blocks(f, self._read_options, parse, self._convert_options)

    def decode(self, batch: pa.RecordBatch) -> DecodedRows:
        n = batch.num_rows
        labels, problems = fd.label_column(batch.column(0), "label")
        dense = np.empty((len(DENSE_NAMES), n), dtype=np.float32)
        for j, name in enumerate(DENSE_NAMES):
            bad = np.zeros(n, dtype=bool)
            fd.decode_counts(*fd.column_buffers(batch.column(1 + j)), dense[j], bad, self.negative_is_bad)
            if bad.any():
                what = "a non-negative integer" if self.negative_is_bad else "an integer"
                problems.append((bad, f"{name} is not {what}"))
        ids = np.empty((len(SPARSE_NAMES), n), dtype=np.int64)
        for f, name in enumerate(SPARSE_NAMES):
            bad = np.zeros(n, dtype=bool)
            fd.decode_hex_ids(*fd.column_buffers(batch.column(1 + len(DENSE_NAMES) + f)), self._salts[f],
                              ids[f], bad)
            if bad.any():
                problems.append((bad, f"{name} is not 8 hex digits"))
        return DecodedRows(labels=labels, dense=dense.T, ids=ids.T, problems=problems)


class CriteoDataModule(LogDataModule):
    """Streams Criteo-layout logs (``.tsv``, ``.gz``, local or fsspec URLs).

    Arguments as :class:`LogDataModule`, plus:

    Args:
        negative_counts: ``"clamp"`` (default) reads a negative count as 0, as the DLRM
            reference preprocessing does: Criteo's I2 holds small negative values in about
            one line of ten, so treating them as bad would drop real data. ``"bad"`` makes
            them bad lines, handled by the ``bad_lines`` policy.

    Example::

        dm = CriteoDataModule(train_paths=["day_0.gz"], val_paths=["day_1.gz"], batch_size=4096)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))   # ctr_lightning.Batch
    """

    format_class = CriteoFormat

    def __init__(
        self,
        train_paths: list[str] | str | None = None,
        val_paths: list[str] | str | None = None,
        test_paths: list[str] | str | None = None,
        predict_paths: list[str] | str | None = None,
        batch_size: int = 4096,
        num_workers: int = 0,
        bad_lines: str = "skip",
        block_size: int = 1 << 19,
        online: bool = False,
        negative_counts: str = "clamp",
    ) -> None:
        self._negative_counts = negative_counts
        super().__init__(train_paths=train_paths, val_paths=val_paths, test_paths=test_paths,
                         predict_paths=predict_paths, batch_size=batch_size, num_workers=num_workers,
                         bad_lines=bad_lines, block_size=block_size, online=online)

    def make_format(self, block_size: int) -> CriteoFormat:
        return CriteoFormat(block_size=block_size, negative_counts=self._negative_counts)
