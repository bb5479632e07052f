"""The streaming reader shared by every log format: shard, parse, drop bad rows, batch."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.batch import Batch
from ctr_lightning.datamodules.bad_lines import MAX_EXAMPLES, BadLineError, BadLineLog, BadLinePolicy
from ctr_lightning.datamodules.sources import FileSlice, iter_lines, plan_slices


@dataclass
class DecodedRows:
    """Model-ready arrays for one record batch, with the rows that failed validation.

    ``problems`` pairs a row mask with the reason; a row is bad if any mask holds it.
    """

    labels: np.ndarray  # [n] float32
    dense: np.ndarray  # [n, num_dense] float32
    ids: np.ndarray  # [n, num_sparse] int64, one id per categorical feature
    problems: list[tuple[np.ndarray, str]]


class LogFormat(Protocol):
    """How one ad-log format is read and turned into arrays."""

    num_fields: int
    delimiter: bytes
    sparse_feature_names: tuple[str, ...]
    num_dense_features: int

    def read(self, fslice: FileSlice, on_invalid_row: callable) -> Iterator[pa.RecordBatch]: ...

    def decode(self, batch: pa.RecordBatch) -> DecodedRows: ...


class LogStreamDataset(IterableDataset):
    """Streams :class:`~ctr_lightning.Batch` es from log files without loading them whole.

    Every (rank, worker) reads a disjoint shard (:func:`plan_slices`), so each example
    is read exactly once per epoch. Batches are built inside the workers; the DataLoader
    must be created with ``batch_size=None``.

    Example::

        ds = LogStreamDataset(["day_0.tsv"], CriteoFormat(), batch_size=4096)
        batch = next(iter(DataLoader(ds, batch_size=None, num_workers=2)))
    """

    def __init__(
        self,
        paths: Sequence[str],
        log_format: LogFormat,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        bad_lines: BadLinePolicy = "skip",
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if bad_lines not in ("skip", "raise"):
            raise ValueError(f"bad_lines must be 'skip' or 'raise', got {bad_lines!r}")
        self.paths = list(paths)
        self.format = log_format
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.bad_lines = bad_lines
        self.drop_last = drop_last

    def _shard(self) -> tuple[int, int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self) -> Iterator[Batch]:
        shard, num_shards = self._shard()
        bad = BadLineLog()
        pending: list[DecodedRows] = []
        buffered = 0
        for fslice in plan_slices(self.paths, shard, num_shards):
            for rows in self._read_slice(fslice, bad):
                pending.append(rows)
                buffered += len(rows.labels)
                while buffered >= self.batch_size:
                    batch, pending = _take(pending, self.batch_size)
                    buffered -= self.batch_size
                    yield self._to_batch(batch)
        if buffered and not self.drop_last:
            yield self._to_batch(_take(pending, buffered)[0])
        bad.summarise(f"reader rank={self.rank} shard={shard}/{num_shards} pid={os.getpid()}")

    def _read_slice(self, fslice: FileSlice, bad: BadLineLog) -> Iterator[DecodedRows]:
        invalid: list[str] = []
        accepted_before = 0  # rows pyarrow accepted earlier in this slice, in all stripes
        # Lines are located only after the slice is read: ("width", nth wrong-width line)
        # or ("value", nth accepted line), with the reason.
        skipped: list[tuple[str, int, str]] = []

        def on_invalid_row(row: object) -> str:
            invalid.append(row.text)  # type: ignore[attr-defined]
            return "skip"

        seen_invalid = 0
        for index, record_batch in enumerate(self.format.read(fslice, on_invalid_row)):
            # pyarrow parses one block per batch, so rows rejected meanwhile belong to it.
            new_invalid = range(seen_invalid, len(invalid))
            seen_invalid = len(invalid)
            if index % fslice.stripes != fslice.stripe:
                accepted_before += record_batch.num_rows
                continue
            for nth in new_invalid:
                reason = self._width_reason(invalid[nth].encode())
                if self.bad_lines == "raise":
                    line, text = self._locate(fslice, nth, wrong_width=True)
                    raise BadLineError(fslice.path, line, reason, text)
                skipped.append(("width", nth, reason))
            rows = self.format.decode(record_batch)
            if rows.problems:
                bad_rows = np.flatnonzero(np.logical_or.reduce([mask for mask, _ in rows.problems]))
                for i in bad_rows:  # in line order, so "raise" names the first bad line
                    reason = next(reason for mask, reason in rows.problems if mask[i])
                    if self.bad_lines == "raise":
                        line, text = self._locate(fslice, accepted_before + int(i), wrong_width=False)
                        raise BadLineError(fslice.path, line, reason, text)
                    skipped.append(("value", accepted_before + int(i), reason))
                if len(bad_rows):
                    keep = np.ones(len(rows.labels), dtype=bool)
                    keep[bad_rows] = False
                    rows = DecodedRows(rows.labels[keep], rows.dense[keep], rows.ids[keep], [])
            if len(rows.labels):
                yield rows
            accepted_before += record_batch.num_rows
        for kind, nth, reason in skipped:
            line, text = None, None
            if len(bad.examples) < MAX_EXAMPLES:
                line, text = self._locate(fslice, nth, wrong_width=kind == "width")
            bad.record(fslice.path, line, reason, text)

    def _width_reason(self, text: bytes) -> str:
        fields = text.count(self.format.delimiter) + 1 if text else 0
        return f"expected {self.format.num_fields} fields, found {fields}"

    def _locate(self, fslice: FileSlice, nth: int, wrong_width: bool) -> tuple[int | None, bytes | None]:
        """Line number and text of the nth wrong-width (or nth well-formed) line of a slice."""
        width = self.format.num_fields
        delimiter = self.format.delimiter
        lines = (
            (n, line) for n, line in iter_lines(fslice)
            if (line.count(delimiter) + 1 != width) == wrong_width
        )
        return next(itertools.islice(lines, nth, None), (None, None))

    def _to_batch(self, rows: DecodedRows) -> Batch:
        n, f = rows.ids.shape
        return Batch(
            dense=torch.from_numpy(rows.dense),
            sparse=KeyedJaggedTensor(
                keys=list(self.format.sparse_feature_names),
                # KJT values are feature-major: all of feature 0's ids, then feature 1's, ...
                values=torch.from_numpy(np.ascontiguousarray(rows.ids.T).reshape(-1)),
                lengths=torch.ones(n * f, dtype=torch.int32),
            ),
            labels=torch.from_numpy(rows.labels),
        )


def _take(pending: list[DecodedRows], n: int) -> tuple[DecodedRows, list[DecodedRows]]:
    """Split the first ``n`` rows off a list of decoded blocks."""
    taken: list[DecodedRows] = []
    need = n
    while need:
        head = pending[0]
        size = len(head.labels)
        if size <= need:
            taken.append(pending.pop(0))
            need -= size
        else:
            taken.append(DecodedRows(head.labels[:need], head.dense[:need], head.ids[:need], []))
            pending[0] = DecodedRows(head.labels[need:], head.dense[need:], head.ids[need:], [])
            need = 0
    if len(taken) == 1:
        return taken[0], pending
    return DecodedRows(
        np.concatenate([t.labels for t in taken]),
        np.concatenate([t.dense for t in taken]),
        np.concatenate([t.ids for t in taken]),
        [],
    ), pending
