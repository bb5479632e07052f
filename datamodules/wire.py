"""The message a reader worker sends the training process: a few batches in one byte tensor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.batch import Batch
from ctr_lightning.datamodules.log_format import DecodedRows


class RawBatch(NamedTuple):
    """What a reader worker sends: a few batches packed into one byte tensor.

    One tensor means one shared-memory segment per message between processes, and a few
    batches per message spread its fixed cost; the KJTs are built on the receiving side,
    where the constant lengths of one-hot features cost nothing to ship. Each batch is
    laid out as ids int64 [one-hot features * n, then every multi-hot feature's values]
    (feature-major, as a KJT keeps them) | multi-hot lengths int32 [multi-hot * n] |
    dense float32 [n, d] | labels float32 [n], padded to 8 bytes | the optional int64
    columns [n] each: groups (GAUC's grouping column), records (predict's row numbers),
    then event_time (POSIX seconds).
    """

    buffer: torch.Tensor
    rows: tuple[int, ...]
    num_dense: int
    num_sparse: int  # one-hot features
    shard: int  # the (rank, worker) shard that read it, for exact resume
    jagged_values: tuple[int, ...] = ()  # per batch: ids of all multi-hot features together
    num_jagged: int = 0
    bad_lines: tuple[tuple[str, int], ...] = ()  # lines skipped since the shard's last message
    columns: tuple[str, ...] = ()  # the optional int64 columns present: "groups", "records", "event_time"
    # Files cut short since the shard's last message (bad_files="skip"), each with its first record not read.
    unreadable: tuple[tuple[str, int], ...] = ()

    @staticmethod
    def pack(batches: list[DecodedRows], shard: int, bad_lines: tuple[tuple[str, int], ...] = (),
             unreadable: tuple[tuple[str, int], ...] = ()) -> RawBatch:
        if not batches:
            return RawBatch(torch.empty(0, dtype=torch.uint8), (), 0, 0, shard, (), 0, bad_lines,
                            unreadable=unreadable)
        f, d, j = batches[0].ids.shape[1], batches[0].dense.shape[1], len(batches[0].jagged)
        columns = tuple(c for c in OPTIONAL_COLUMNS if getattr(batches[0], c) is not None)
        sizes = [_padded(8 * (f * len(b) + sum(len(x.values) for x in b.jagged)) + 4 * (j + d + 1) * len(b))
                 + 8 * len(columns) * len(b) for b in batches]
        buffer = np.empty(sum(sizes), dtype=np.uint8)
        start = 0
        for b, size in zip(batches, sizes):
            n = len(b)
            region = _Regions(start, n, f, d, j, sum(len(x.values) for x in b.jagged), len(columns))
            ids = buffer[region.ids].view(np.int64)
            ids[: f * n].reshape(f, n)[:] = b.ids.T
            if j:
                ids[f * n :] = np.concatenate([x.values for x in b.jagged])
                buffer[region.lengths].view(np.int32).reshape(j, n)[:] = np.stack([x.lengths for x in b.jagged])
            buffer[region.dense].view(np.float32).reshape(n, d)[:] = b.dense
            buffer[region.labels].view(np.float32)[:] = b.labels
            for c, name in enumerate(columns):
                buffer[region.column(c)].view(np.int64)[:] = getattr(b, name)
            start += size
        return RawBatch(torch.from_numpy(buffer), tuple(len(b) for b in batches), d, f, shard,
                        tuple(sum(len(x.values) for x in b.jagged) for b in batches), j, bad_lines, columns, unreadable)

    def to_batches(self, keys: list[str], ones: _Ones) -> Iterator[Batch]:
        d, f, j = self.num_dense, self.num_sparse, self.num_jagged
        start = 0
        for k, n in enumerate(self.rows):
            jagged_values = self.jagged_values[k] if j else 0
            region = _Regions(start, n, f, d, j, jagged_values, len(self.columns))
            lengths = ones(f * n)
            if j:
                lengths = torch.cat([lengths, self.buffer[region.lengths].view(torch.int32)])
            extra = {name: self.buffer[region.column(c)].view(torch.int64) for c, name in enumerate(self.columns)}
            yield Batch(
                dense=self.buffer[region.dense].view(torch.float32).view(n, d),
                sparse=KeyedJaggedTensor(keys=keys, values=self.buffer[region.ids].view(torch.int64), lengths=lengths),
                labels=self.buffer[region.labels].view(torch.float32),
                **extra,
            )
            start += region.size


OPTIONAL_COLUMNS = ("groups", "records", "event_time")


class _Ones:
    """Shared all-ones one-hot lengths, one tensor per size.

    Filling a fresh tensor each batch costs more than it seems on a busy machine: the
    fill is parallel, and its threads wait for cores the reader workers hold.
    """

    def __init__(self) -> None:
        self._by_size: dict[int, torch.Tensor] = {}

    def __call__(self, size: int) -> torch.Tensor:
        ones = self._by_size.get(size)
        if ones is None:
            if len(self._by_size) > 4:  # sizes other than the batch size come once an epoch
                self._by_size.clear()
            ones = self._by_size[size] = torch.ones(size, dtype=torch.int32)
        return ones


def _padded(size: int) -> int:
    return (size + 7) // 8 * 8  # every batch starts 8-byte aligned, for its int64 ids


class _Regions:
    """Byte ranges of one packed batch (see :class:`RawBatch`)."""

    def __init__(self, start: int, n: int, f: int, d: int, j: int, jagged_values: int, columns: int = 0) -> None:
        ids_end = start + 8 * (f * n + jagged_values)
        lengths_end = ids_end + 4 * j * n
        dense_end = lengths_end + 4 * d * n
        labels_end = dense_end + 4 * n
        self.ids = slice(start, ids_end)
        self.lengths = slice(ids_end, lengths_end)
        self.dense = slice(lengths_end, dense_end)
        self.labels = slice(dense_end, labels_end)
        self._columns_start, self._n = start + _padded(labels_end - start), n
        self.size = _padded(labels_end - start) + 8 * columns * n

    def column(self, c: int) -> slice:
        """The c-th optional int64 column."""
        first = self._columns_start + 8 * c * self._n
        return slice(first, first + 8 * self._n)
