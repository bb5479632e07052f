"""The streaming reader shared by every log format: shard, parse, drop bad rows, batch."""

from __future__ import annotations

import itertools
import logging
import os
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.batch import Batch
from ctr_lightning.datamodules.bad_lines import MAX_EXAMPLES, BadLineError, BadLineLog, BadLinePolicy
from ctr_lightning.datamodules.sources import FileSlice, iter_lines, plan_slices

log = logging.getLogger(__name__)


@dataclass
class JaggedIds:
    """A multi-hot feature of n rows: ``lengths[i]`` ids of row i, all in ``values``."""

    lengths: np.ndarray  # [n] int32
    values: np.ndarray  # [lengths.sum()] int64

    def _offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    def slice(self, start: int, stop: int) -> JaggedIds:
        offsets = self._offsets()
        return JaggedIds(self.lengths[start:stop], self.values[offsets[start] : offsets[stop]])

    def select(self, keep: np.ndarray) -> JaggedIds:
        return JaggedIds(self.lengths[keep], self.values[np.repeat(keep, self.lengths)])

    @staticmethod
    def concat(parts: list[JaggedIds]) -> JaggedIds:
        return JaggedIds(np.concatenate([p.lengths for p in parts]), np.concatenate([p.values for p in parts]))


@dataclass
class DecodedRows:
    """Model-ready arrays for one record batch, with the rows that failed validation.

    ``problems`` pairs a row mask with the reason; a row is bad if any mask holds it.
    """

    labels: np.ndarray  # [n] float32
    dense: np.ndarray  # [n, num_dense] float32
    ids: np.ndarray  # [n, num_one_hot] int64, one id per one-hot categorical feature
    problems: list[tuple[np.ndarray, str]]
    jagged: tuple[JaggedIds, ...] = ()  # multi-hot features, after the one-hot ones

    def __len__(self) -> int:
        return len(self.labels)

    def slice(self, start: int, stop: int) -> DecodedRows:
        return DecodedRows(self.labels[start:stop], self.dense[start:stop], self.ids[start:stop], [],
                           tuple(j.slice(start, stop) for j in self.jagged))

    def select(self, keep: np.ndarray) -> DecodedRows:
        return DecodedRows(self.labels[keep], self.dense[keep], self.ids[keep], [],
                           tuple(j.select(keep) for j in self.jagged))

    @staticmethod
    def concat(parts: list[DecodedRows]) -> DecodedRows:
        return DecodedRows(
            np.concatenate([p.labels for p in parts]),
            np.concatenate([p.dense for p in parts]),
            np.concatenate([p.ids for p in parts]),
            [],
            tuple(JaggedIds.concat([p.jagged[k] for p in parts]) for k in range(len(parts[0].jagged))),
        )


class LogFormat(Protocol):
    """How one ad-log format is read and turned into arrays."""

    line_based: bool  # records are lines: byte-range shards, errors named by file:line
    num_fields: int
    delimiter: bytes
    header_lines: int  # lines at the top of each file that are not records
    sparse_feature_names: tuple[str, ...]
    num_dense_features: int

    def read(self, fslice: FileSlice, on_invalid_row: callable) -> Iterator[pa.RecordBatch]: ...

    def decode(self, batch: pa.RecordBatch) -> DecodedRows: ...

    # Optional: ``warm_up()`` loads compiled code in the main process before workers fork.


class LogStreamDataset(IterableDataset):
    """Streams batches of examples from log files without loading them whole.

    Every (rank, worker) reads a disjoint shard (:func:`plan_slices`), so each example
    is read exactly once per epoch. Batches are cut inside the workers, as
    :class:`RawBatch` es; :class:`BatchDataLoader` turns them into ``Batch`` es.

    Example::

        ds = LogStreamDataset(["day_0.tsv"], CriteoFormat(), batch_size=4096)
        batch = next(iter(BatchDataLoader(ds, num_workers=2)))
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
        message_rows: int = 1 << 16,
        skip_batches: dict[int, int] | None = None,
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
        # Workers ship about message_rows rows at a time: the per-message cost of
        # inter-process transfer is fixed, so fewer, larger messages read faster.
        self.batches_per_message = max(1, message_rows // batch_size)
        # Batches each shard already delivered before a restart: read again, not sent again.
        self.skip_batches = dict(skip_batches or {})

    def _shard(self) -> tuple[int, int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self) -> Iterator[RawBatch]:
        shard, num_shards = self._shard()
        # Kept on the dataset, so a reader in this process can look at the counts afterwards.
        bad = self.bad_line_log = BadLineLog()
        skip = self.skip_batches.get(shard, 0)
        pending: list[DecodedRows] = []
        ready: list[DecodedRows] = []
        buffered = 0

        def cut(rows: int) -> None:
            nonlocal pending, skip
            batch, pending = _take(pending, rows)
            if skip:
                skip -= 1
            else:
                ready.append(batch)

        for fslice in plan_slices(self.paths, shard, num_shards, self.format.line_based):
            for rows in self._read_slice(fslice, bad):
                pending.append(rows)
                buffered += len(rows.labels)
                while buffered >= self.batch_size:
                    cut(self.batch_size)
                    buffered -= self.batch_size
                    if len(ready) == self.batches_per_message:
                        yield RawBatch.pack(ready, shard, bad.unshipped())
                        ready = []
        if buffered and not self.drop_last:
            cut(buffered)
        counts = bad.unshipped()
        if ready or counts:  # the last counts travel even without a batch
            yield RawBatch.pack(ready, shard, counts)
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

        def reject_wrong_width(nths: range) -> None:
            for nth in nths:
                reason = self._width_reason(invalid[nth].encode())
                if self.bad_lines == "raise":
                    line, text = self._locate(fslice, nth, wrong_width=True)
                    raise BadLineError(fslice.path, line, reason, text)
                skipped.append(("width", nth, reason))

        seen_invalid = 0
        batches = 0
        readable = True
        try:
            for index, record_batch in enumerate(self.format.read(fslice, on_invalid_row)):
                batches = index + 1
                # pyarrow parses one block per batch, so rows rejected meanwhile belong to it.
                new_invalid = range(seen_invalid, len(invalid))
                seen_invalid = len(invalid)
                if index % fslice.stripes != fslice.stripe:
                    accepted_before += record_batch.num_rows
                    continue
                reject_wrong_width(new_invalid)
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
                        rows = rows.select(keep)
                if len(rows.labels):
                    yield rows
                accepted_before += record_batch.num_rows
            # Rows rejected after the last batch (a block of nothing but wrong-width lines
            # yields no batch): reported by the one stripe that the next batch would be.
            if batches % fslice.stripes == fslice.stripe:
                reject_wrong_width(range(seen_invalid, len(invalid)))
        except (EOFError, OSError, zlib.error, pa.ArrowException) as e:
            # A truncated or corrupt file: what was read stands; the rest is named, not lost silently.
            reason = f"unreadable after its first {accepted_before} rows ({type(e).__name__}: {e})"
            if self.bad_lines == "raise":
                raise BadLineError(fslice.path, None, reason) from e
            log.error("%s: %s", fslice.path, reason)
            bad.record(fslice.path, None, reason)
            readable = False
        for kind, nth, reason in skipped:
            line, text = None, None
            if readable and len(bad.examples) < MAX_EXAMPLES:
                line, text = self._locate(fslice, nth, wrong_width=kind == "width")
            bad.record(fslice.path, line, reason, text)

    def _width_reason(self, text: bytes) -> str:
        fields = text.count(self.format.delimiter) + 1 if text else 0
        return f"expected {self.format.num_fields} fields, found {fields}"

    def _locate(self, fslice: FileSlice, nth: int, wrong_width: bool) -> tuple[int | None, bytes | None]:
        """Line number and text of the nth wrong-width (or nth well-formed) line of a slice.

        For formats without lines (Parquet), the row number in the file."""
        if not self.format.line_based:
            return nth + 1, None
        width = self.format.num_fields
        delimiter = self.format.delimiter
        header = self.format.header_lines
        lines = (
            (n, line) for n, line in iter_lines(fslice)
            if n > header and (line.count(delimiter) + 1 != width) == wrong_width
        )
        return next(itertools.islice(lines, nth, None), (None, None))



class RawBatch(NamedTuple):
    """What a reader worker sends: a few batches packed into one byte tensor.

    One tensor means one shared-memory segment per message between processes, and a few
    batches per message spread its fixed cost; the KJTs are built on the receiving side,
    where the constant lengths of one-hot features cost nothing to ship. Each batch is
    laid out as ids int64 [one-hot features * n, then every multi-hot feature's values]
    (feature-major, as a KJT keeps them) | multi-hot lengths int32 [multi-hot * n] |
    dense float32 [n, d] | labels float32 [n], padded to 8 bytes.
    """

    buffer: torch.Tensor
    rows: tuple[int, ...]
    num_dense: int
    num_sparse: int  # one-hot features
    shard: int  # the (rank, worker) shard that read it, for exact resume
    jagged_values: tuple[int, ...] = ()  # per batch: ids of all multi-hot features together
    num_jagged: int = 0
    bad_lines: tuple[tuple[str, int], ...] = ()  # lines skipped since the shard's last message

    @staticmethod
    def pack(batches: list[DecodedRows], shard: int, bad_lines: tuple[tuple[str, int], ...] = ()) -> RawBatch:
        if not batches:
            return RawBatch(torch.empty(0, dtype=torch.uint8), (), 0, 0, shard, (), 0, bad_lines)
        f, d, j = batches[0].ids.shape[1], batches[0].dense.shape[1], len(batches[0].jagged)
        sizes = [_padded(8 * (f * len(b) + sum(len(x.values) for x in b.jagged)) + 4 * (j + d + 1) * len(b))
                 for b in batches]
        buffer = np.empty(sum(sizes), dtype=np.uint8)
        start = 0
        for b, size in zip(batches, sizes):
            n = len(b)
            region = _Regions(start, n, f, d, j, sum(len(x.values) for x in b.jagged))
            ids = buffer[region.ids].view(np.int64)
            ids[: f * n].reshape(f, n)[:] = b.ids.T
            if j:
                ids[f * n :] = np.concatenate([x.values for x in b.jagged])
                buffer[region.lengths].view(np.int32).reshape(j, n)[:] = np.stack([x.lengths for x in b.jagged])
            buffer[region.dense].view(np.float32).reshape(n, d)[:] = b.dense
            buffer[region.labels].view(np.float32)[:] = b.labels
            start += size
        return RawBatch(torch.from_numpy(buffer), tuple(len(b) for b in batches), d, f, shard,
                        tuple(sum(len(x.values) for x in b.jagged) for b in batches), j, bad_lines)

    def to_batches(self, keys: list[str], ones: _Ones) -> Iterator[Batch]:
        d, f, j = self.num_dense, self.num_sparse, self.num_jagged
        start = 0
        for k, n in enumerate(self.rows):
            jagged_values = self.jagged_values[k] if j else 0
            region = _Regions(start, n, f, d, j, jagged_values)
            lengths = ones(f * n)
            if j:
                lengths = torch.cat([lengths, self.buffer[region.lengths].view(torch.int32)])
            yield Batch(
                dense=self.buffer[region.dense].view(torch.float32).view(n, d),
                sparse=KeyedJaggedTensor(keys=keys, values=self.buffer[region.ids].view(torch.int64), lengths=lengths),
                labels=self.buffer[region.labels].view(torch.float32),
            )
            start += region.size


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

    def __init__(self, start: int, n: int, f: int, d: int, j: int, jagged_values: int) -> None:
        ids_end = start + 8 * (f * n + jagged_values)
        lengths_end = ids_end + 4 * j * n
        dense_end = lengths_end + 4 * d * n
        labels_end = dense_end + 4 * n
        self.ids = slice(start, ids_end)
        self.lengths = slice(ids_end, lengths_end)
        self.dense = slice(lengths_end, dense_end)
        self.labels = slice(dense_end, labels_end)
        self.size = _padded(labels_end - start)


class BatchDataLoader(DataLoader):
    """A DataLoader over a :class:`LogStreamDataset` that yields :class:`~ctr_lightning.Batch` es.

    With ``sync_group`` (a gloo process group over all ranks), every rank yields the same
    number of batches: before each batch the ranks agree that all of them still have one,
    and the first to run out ends the pass for everyone, so the last collective of an
    epoch never waits for a rank that has finished. The batches the other ranks hold back
    then are counted and logged, never dropped silently.

    Example::

        loader = BatchDataLoader(LogStreamDataset(["day_0.tsv"], CriteoFormat(), batch_size=4096),
                                 num_workers=2)
        for batch in loader: ...
    """

    def __init__(self, dataset: LogStreamDataset, sync_group: Any = None, **kwargs: Any) -> None:
        kwargs["batch_size"] = None  # the dataset yields whole batches, built in the workers
        super().__init__(dataset, **kwargs)
        self.sync_group = sync_group
        self.shard_log: list[int] = []  # the shard of every batch handed out, in order
        self.held_back = (0, 0)  # (batches, examples) of the last pass not handed out to keep ranks even
        self.bad_line_counts: Counter[str] = Counter()  # lines skipped this pass, per file, all workers
        self._ones = _Ones()

    def _batches(self) -> Iterator[tuple[int, Batch]]:
        keys = list(self.dataset.format.sparse_feature_names)
        warm_up = getattr(self.dataset.format, "warm_up", None)
        if warm_up is not None and self.num_workers > 0:
            warm_up()
        for raw in super().__iter__():
            raw = RawBatch(*raw)
            self.bad_line_counts.update(dict(raw.bad_lines))
            for batch in raw.to_batches(keys, self._ones):
                yield raw.shard, batch

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        self.shard_log = []
        self.held_back = (0, 0)
        self.bad_line_counts = Counter()
        batches = self._batches()
        while True:
            item = next(batches, None)
            if self.sync_group is not None and not _all_ranks_have(item is not None, self.sync_group):
                if item is not None:
                    self._hold_back(item, batches)
                return
            if item is None:
                return
            self.shard_log.append(item[0])
            yield item[1]

    def _hold_back(self, item: tuple[int, Batch], rest: Iterator[tuple[int, Batch]]) -> None:
        count, examples = 1, len(item[1])
        for _, batch in rest:
            count, examples = count + 1, examples + len(batch)
        self.held_back = (count, examples)
        log.warning(
            "rank %d: another rank ran out of data first; %d batches (%d examples) of this epoch were not "
            "used, to keep every rank at the same step count", self.dataset.rank, count, examples)

    def position(self, batches: int) -> dict[int, int]:
        """Batches per shard among the first ``batches`` handed out this pass."""
        counts: dict[int, int] = {}
        for shard in self.shard_log[:batches]:
            counts[shard] = counts.get(shard, 0) + 1
        return counts


def _take(pending: list[DecodedRows], n: int) -> tuple[DecodedRows, list[DecodedRows]]:
    """Split the first ``n`` rows off a list of decoded blocks."""
    taken: list[DecodedRows] = []
    need = n
    while need:
        head = pending[0]
        size = len(head)
        if size <= need:
            taken.append(pending.pop(0))
            need -= size
        else:
            taken.append(head.slice(0, need))
            pending[0] = head.slice(need, size)
            need = 0
    return (taken[0] if len(taken) == 1 else DecodedRows.concat(taken)), pending


def _all_ranks_have(have: bool, group: Any) -> bool:
    flag = torch.tensor([1 if have else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())
