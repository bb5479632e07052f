"""The streaming reader shared by every log format: shard, parse, drop bad rows, cut batches."""

from __future__ import annotations

import itertools
import logging
import os
import zlib
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
from torch.utils.data import IterableDataset, get_worker_info

from ctr_lightning.datamodules.bad_lines import MAX_EXAMPLES, BadLineError, BadLineLog, BadLinePolicy
from ctr_lightning.datamodules.log_format import DecodedRows, LogFormat
from ctr_lightning.datamodules.sources import FileSlice, iter_lines, plan_slices
from ctr_lightning.datamodules.wire import RawBatch

log = logging.getLogger(__name__)


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
