"""The streaming reader shared by every log format: shard, parse, drop bad rows, cut batches."""

from __future__ import annotations

import itertools
import logging
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
from torch.utils.data import IterableDataset, get_worker_info

from ctr_lightning.datamodules.bad_lines import (MAX_EXAMPLES, BadFilePolicy, BadLineError, BadLineLog, BadLinePolicy,
                                                 UnreadableFileError, unreadable_reason)
from ctr_lightning.datamodules.format_hints import format_hint
from ctr_lightning.datamodules.log_format import DecodedRows, LogFormat
from ctr_lightning.datamodules.row_index import FileIndex, index_files
from ctr_lightning.datamodules.shard_plan import plan_shard, rank_intervals
from ctr_lightning.datamodules.sources import FileSlice, iter_lines, slice_event_time
from ctr_lightning.datamodules.wire import RawBatch

log = logging.getLogger(__name__)


class LogStreamDataset(IterableDataset):
    """Streams batches of examples from log files without loading them whole.

    Every (rank, worker) reads an equal share of the files' records (:func:`plan_shard`),
    so each example is read exactly once per epoch and every rank cuts the same number of
    batches. Batches are cut inside the workers, as :class:`RawBatch` es;
    :class:`BatchDataLoader` turns them into ``Batch`` es.

    Args:
        paths: the files, in the order their records are read.
        log_format: how they are read and decoded.
        batch_size: examples per batch.
        rank, world_size: this rank's place among the ranks that share the files.
        bad_lines: ``"skip"`` (count and log) or ``"raise"`` (stop with file:line).
        bad_files: a file that cannot be read to its end: ``"fail"`` raises
            :class:`UnreadableFileError` naming it and the first record not read (here, if
            its index already found the break, else from the reader); ``"skip"`` reads the
            records before the break and logs the file, counted as one unreadable file
            (``BatchDataLoader.unreadable_files``), not as bad lines.
        max_bad_fraction: a file slice whose bad lines exceed this share of its lines (and
            10 lines) stops the run, naming the file (None: no limit).
        files: the files' indexes, when the caller has them (else they are counted here).
        epoch, seed, rotate: with ``rotate``, which ranks read which pieces changes with
            the epoch (and seed).
        numbered: every batch carries each example's place among the files' records
            (``Batch.records``, 0-based, file after file, header lines not counted), as
            predictions need to be joined back to their input.
        partition_time: every batch carries each example's event time from its file's
            Hive date partition (``Batch.event_time``); a file without one is refused.

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
        max_bad_fraction: float | None = None,
        files: Sequence[FileIndex] | None = None,
        epoch: int = 0,
        seed: int = 0,
        rotate: bool = False,
        numbered: bool = False,
        bad_files: BadFilePolicy = "fail",
        partition_time: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if bad_lines not in ("skip", "raise"):
            raise ValueError(f"bad_lines must be 'skip' or 'raise', got {bad_lines!r}")
        if bad_files not in ("fail", "skip"):
            raise ValueError(f"bad_files must be 'fail' or 'skip', got {bad_files!r}")
        if max_bad_fraction is not None and not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must be in [0, 1] or None, got {max_bad_fraction}")
        self.paths = list(paths)
        self.format = log_format
        self.files = list(files) if files is not None else index_log_files(self.paths, log_format)
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.bad_lines = bad_lines
        self.bad_files = bad_files
        self._check_readable()
        self.max_bad_fraction = max_bad_fraction
        self.drop_last = drop_last
        self.epoch, self.seed, self.rotate = epoch, seed, rotate
        self.numbered = numbered
        self.partition_time = partition_time
        if partition_time:
            for path in self.paths:
                _partition_seconds(path)  # a file without a date partition is refused before any reading
        if numbered and len({f.path for f in self.files}) < len(self.files):
            twice = sorted({f.path for f in self.files if sum(g.path == f.path for g in self.files) > 1})
            raise ValueError(f"predict_paths name {twice} more than once: their rows could not be told apart")
        starts = np.cumsum([0] + [f.records for f in self.files])
        self._file_starts = {f.path: int(start) for f, start in zip(self.files, starts)}
        # Workers ship about message_rows rows at a time: the per-message cost of
        # inter-process transfer is fixed, so fewer, larger messages read faster.
        self.batches_per_message = max(1, message_rows // batch_size)
        # Batches each shard already delivered before a restart: read again, not sent again,
        # in the epoch the restart happened in (``epoch`` as given here) only.
        self.skip_batches = dict(skip_batches or {})
        self.skip_epoch = epoch

    def _check_readable(self) -> None:
        """Files whose index found a break: the run stops here, in the main process, before
        any reader starts; or, with ``bad_files="skip"``, the file is logged once. (Their
        slices end at the last whole record, so no reader meets the break itself.)"""
        for index in self.files:
            if index.unreadable is None:
                continue
            if self.bad_files == "fail":
                raise UnreadableFileError(index.path, index.first + index.records + 1, index.unreadable)
            log.error("%s: %s; bad_files='skip': its first %d records are read, the rest of the file is skipped",
                      index.path, unreadable_reason(index.first + index.records + 1, index.unreadable),
                      index.first + index.records)

    def expected_batches(self, largest_share: bool = False) -> int:
        """Batches every rank yields in a pass, from the files' record counts (fewer if lines
        are bad): the rank with the smallest share decides, as the ranks stay in step; with
        ``largest_share``, the largest (ranks padded until the last is done, as in predict)."""
        total = sum(f.records for f in self.files)
        share = -(-total // self.world_size) if largest_share else total // self.world_size
        return -(-share // self.batch_size) if not self.drop_last else share // self.batch_size

    def plan(self, worker: int, num_workers: int) -> list[FileSlice]:
        """What worker ``worker`` of ``num_workers`` of this rank reads this epoch."""
        return plan_shard(self.files, self.rank, self.world_size, worker, num_workers, self.batch_size,
                          self.epoch, self.seed, self.rotate)

    def __iter__(self) -> Iterator[RawBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shard, num_shards = self.rank * workers + worker, self.world_size * workers
        # Kept on the dataset, so a reader in this process can look at the counts afterwards.
        bad = self.bad_line_log = BadLineLog()
        # A loader is reused from epoch to epoch: the next epoch reads everything again.
        skip = self.skip_batches.get(shard, 0) if self.epoch == self.skip_epoch else 0
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

        for fslice in self.plan(worker, workers):
            for rows in self._read_slice(fslice, bad):
                pending.append(rows)
                buffered += len(rows.labels)
                while buffered >= self.batch_size:
                    cut(self.batch_size)
                    buffered -= self.batch_size
                    if len(ready) == self.batches_per_message:
                        yield RawBatch.pack(ready, shard, bad.unshipped(), bad.unshipped_unreadable())
                        ready = []
        if buffered and not self.drop_last:
            cut(buffered)
        counts, broken = bad.unshipped(), bad.unshipped_unreadable()
        if ready or counts or broken:  # the last counts travel even without a batch
            yield RawBatch.pack(ready, shard, counts, broken)
        bad.summarise(f"reader rank={self.rank} shard={shard}/{num_shards} pid={os.getpid()}")

    def _read_slice(self, fslice: FileSlice, bad: BadLineLog) -> Iterator[DecodedRows]:
        invalid: list[str] = []
        accepted_before = 0  # rows the parser accepted earlier in this slice
        # Lines are located only after the slice is read: ("width", nth wrong-width line)
        # or ("value", nth accepted line), with the reason.
        skipped: list[tuple[str, int, str]] = []

        def on_invalid_row(row: object) -> str:
            invalid.append(row.text)  # type: ignore[attr-defined]
            return "skip"

        def reject_wrong_width(nths: range) -> None:
            for nth in nths:
                reason = self._width_reason(invalid[nth].encode(), fslice.path)
                if self.bad_lines == "raise":
                    line, text = self._locate(fslice, nth, wrong_width=True)
                    raise BadLineError(fslice.path, line, reason, text)
                skipped.append(("width", nth, reason))

        seen_invalid = 0
        readable = True
        when = _partition_seconds(fslice.path) if self.partition_time else None
        wrong_width_at: np.ndarray | None = None  # where in the slice the wrong-width lines are, once needed
        try:
            for record_batch in self.format.read(fslice, on_invalid_row):
                # One block per batch, so rows rejected meanwhile belong to it.
                reject_wrong_width(range(seen_invalid, len(invalid)))
                seen_invalid = len(invalid)
                rows = self.format.decode(record_batch)
                if not self.numbered and len(rows.labels) and np.isnan(rows.labels).any():
                    reason = getattr(self.format, "unlabeled_reason", None) or "no labels"
                    raise BadLineError(fslice.path, None, f"{reason}; only predict_paths may be unlabeled")
                if self.numbered:
                    if invalid and wrong_width_at is None:
                        wrong_width_at = self._wrong_width_lines(fslice)
                    rows.records = self._file_starts[fslice.path] + fslice.first + _accepted_positions(
                        accepted_before, record_batch.num_rows, wrong_width_at)
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
                accepted_before += record_batch.num_rows
                self._check_bad_share(fslice, len(skipped), accepted_before + len(invalid), skipped)
                if when is not None:
                    rows.event_time = np.full(len(rows.labels), when, dtype=np.int64)
                if len(rows.labels):
                    yield rows
            # Lines rejected after the last block (one of nothing but wrong-width lines
            # yields no batch).
            reject_wrong_width(range(seen_invalid, len(invalid)))
        except (EOFError, OSError, zlib.error, pa.ArrowException) as e:
            # A break the index did not see (a damaged Parquet page, an I/O error): the
            # records before it were read; the first one after is named.
            record = fslice.first + accepted_before + len(invalid) + 1
            error = f"{type(e).__name__}: {e}"
            if self.bad_files == "fail":
                raise UnreadableFileError(fslice.path, record, error) from e
            log.error("%s: %s; bad_files='skip': the rest of the file is skipped", fslice.path,
                      unreadable_reason(record, error))
            bad.record_unreadable(fslice.path, record)
            readable = False
        self._check_bad_share(fslice, len(skipped), accepted_before + len(invalid), skipped, final=True)
        for kind, nth, reason in skipped:
            line, text = None, None
            if readable and len(bad.examples) < MAX_EXAMPLES:
                line, text = self._locate(fslice, nth, wrong_width=kind == "width")
            bad.record(fslice.path, line, reason, text)

    def _check_bad_share(self, fslice: FileSlice, bad: int, lines: int, skipped: list[tuple[str, int, str]],
                         final: bool = False) -> None:
        """Stop when more than ``max_bad_fraction`` of the lines read so far (and at least
        ``_TOLERATED_BAD_LINES``) are bad: the file is not what this format reads."""
        if self.max_bad_fraction is None or bad <= max(self.max_bad_fraction * lines, _TOLERATED_BAD_LINES):
            return
        examples = []
        for kind, nth, reason in skipped[:3]:
            line, text = self._locate(fslice, nth, wrong_width=kind == "width")
            examples.append(str(BadLineError(fslice.path, line, reason, text)))
        index = next((f for f in self.files if f.path == fslice.path), None)
        hint = format_hint(index.head if index is not None else b"", type(self.format).__name__)
        raise TooManyBadLinesError(
            f"{fslice.path}: {bad} of the {lines} lines read {'' if final else 'so far '}are bad "
            f"({bad / max(lines, 1):.1%}), more than max_bad_fraction={self.max_bad_fraction}; first: "
            + "; ".join(examples) + (f". {hint}" if hint else ""))

    def _wrong_width_lines(self, fslice: FileSlice) -> np.ndarray:
        """Positions in the slice (0-based) of its lines of the wrong width: one more read of
        the slice, paid only when predicting over a file that has them."""
        expected = self._expected_fields(fslice.path)
        return np.array([i for i, (_, line) in enumerate(iter_lines(fslice)) if self._fields(line) != expected],
                        dtype=np.int64)

    def _fields(self, line: bytes) -> int:
        """Fields of a line as the format's parser splits it (quotes, where it has them)."""
        count = getattr(self.format, "count_fields", None)
        if count is not None:
            return count(line)
        return line.count(self.format.delimiter) + 1 if line else 0

    def _expected_fields(self, path: str) -> int:
        """Fields of a record of this file: a format may read files of more than one width
        (Criteo with or without its label; a header naming the columns), one width a file."""
        per_file = getattr(self.format, "fields_of", None)
        return per_file(path) if per_file is not None else self.format.num_fields

    def _width_reason(self, text: bytes, path: str) -> str:
        return f"expected {self._expected_fields(path)} fields, found {self._fields(text)}"

    def _locate(self, fslice: FileSlice, nth: int, wrong_width: bool) -> tuple[int | None, bytes | None]:
        """Line number and text of the nth wrong-width (or nth well-formed) line of a slice.

        For formats without lines (Parquet), the row number in the file."""
        if not self.format.line_based:
            return fslice.first + nth + 1, None
        expected = self._expected_fields(fslice.path)
        lines = ((n, line) for n, line in iter_lines(fslice) if (self._fields(line) != expected) == wrong_width)
        return next(itertools.islice(lines, nth, None), (None, None))

    def describe_empty(self, bad_line_counts: Mapping[str, int]) -> str:
        """Why this rank got no example this epoch, for the error that says so."""
        total = sum(f.records for f in self.files)
        paths = [f.path for f in self.files]
        if total == 0:
            unreadable = [f.path for f in self.files if f.unreadable is not None]
            return f"the files hold no record: {paths}" + (f" (unreadable: {unreadable})" if unreadable else "")
        mine = sum(b - a for a, b in rank_intervals(total, self.rank, self.world_size, self.epoch, self.seed,
                                                     self.rotate))
        if mine == 0:
            return (f"rank {self.rank} has no record to read: the files hold {total} records for "
                    f"{self.world_size} ranks: {paths}")
        bad = sum(bad_line_counts.values())
        if bad:
            hints = [f"{f.path}: {hint}" for f in self.files if f.path in bad_line_counts
                     and (hint := format_hint(f.head, type(self.format).__name__))]
            return (f"all {bad} lines this rank read were bad ({dict(bad_line_counts)}); "
                    + (" ".join(hints) if hints else f"set bad_lines='raise' to see the first, or check the format "
                                                     f"of {paths}"))
        return f"no example came out of {mine} records of {paths}"


_TOLERATED_BAD_LINES = 10  # so a small file with a stray bad line or two still trains


class TooManyBadLinesError(BadLineError):
    """A file whose share of bad lines says it is not what the reader expects."""


def index_log_files(paths: Sequence[str], log_format: LogFormat, cache_dir: str | None = None) -> list[FileIndex]:
    """The index of every file, checked against the format (a header it expects)."""
    check = getattr(log_format, "check_file", None)
    return index_files(paths, log_format.header_lines, not log_format.line_based, cache_dir, check)


def _accepted_positions(first: int, count: int, skipped: np.ndarray | None) -> np.ndarray:
    """Positions in a slice of its accepted rows ``first .. first + count - 1``, the rows at
    the sorted positions ``skipped`` not counted as accepted."""
    accepted = np.arange(first, first + count, dtype=np.int64)
    if skipped is None or not len(skipped):
        return accepted
    accepted_before_each = skipped - np.arange(len(skipped))  # accepted rows in front of each skipped one
    return accepted + np.searchsorted(accepted_before_each, accepted, side="right")


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


def _partition_seconds(path: str) -> int:
    """A file's event time from its Hive date (and hour) partitions (``partition_time``)."""
    when = slice_event_time([path])
    if when is None:
        raise ValueError(f"{path}: partition_time=True takes each record's event time from its date partition "
                         f"(dt=, date=, day= or ds=, with an optional hour=), but this path has none")
    return int(when)
