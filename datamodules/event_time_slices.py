"""Online time slices cut by each record's event time, not by file or partition.

A log whose files do not follow the clock (one big export, a file per ad server, a day
file with every hour inside) is cut into windows of event time: an hour, a day. The
records stay in the order they are read (files in name order, lines in file order), so
a slice is a run of consecutive records: it starts at the first record whose event time
reaches its window, and a late record (an event time of an earlier window, read after a
later one began) trains in the slice it is read in, as it would in a run that trains
each record when it arrives. A record without a valid event time (a bad line) stays in
the slice of the record before it.

Cutting costs one read of the training files, at set-up; each file's cuts are kept in
the row-index cache (keyed by the file's path, size and modification time, the
window, and the reader's settings), so a resumed run and the other ranks read them.

Example::

    slices = cut_event_time_slices(indexes, log_format, window=3600, settings="criteo-v1")
    [s.name for s in slices]   # ['2026-12-01T05:00:00Z', '2026-12-01T06:00:00Z', ...]
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ctr_lightning.datamodules.bad_lines import BadLineLog
from ctr_lightning.datamodules.log_format import LogFormat
from ctr_lightning.datamodules.row_index import FileIndex, RowIndexCache
from ctr_lightning.datamodules.sources import FileSlice

log = logging.getLogger(__name__)

_VERSION = 1


@dataclass(frozen=True)
class EventTimeSlice:
    """One window of event time: ``[start, start + window)`` POSIX seconds (UTC), and the
    record ranges that train in it, as file indexes of a part of their file
    (:attr:`FileIndex.first` and :attr:`FileIndex.records`).

    Example::

        s = slices[0]
        s.name, s.start, [(p.path, p.first, p.records) for p in s.parts]
        # ('2026-12-01T05:00:00Z', 1796101200, [('log.csv', 0, 51234)])
    """

    start: int
    parts: tuple[FileIndex, ...]

    @property
    def name(self) -> str:
        when = datetime.datetime.fromtimestamp(self.start, tz=datetime.timezone.utc)
        return when.strftime("%Y-%m-%dT%H:%M:%SZ")

    @property
    def records(self) -> int:
        return sum(p.records for p in self.parts)

    def describe(self) -> list[str]:
        """Each part as ``path#first:stop`` (records, 0-based, header lines not counted)."""
        return [f"{p.path}#{p.first}:{p.first + p.records}" for p in self.parts]


def file_windows(index: FileIndex, log_format: LogFormat, window: int,
                 partition_time: bool = False) -> list[tuple[int, int]]:
    """Where one file's running maximum of event time enters each new window: ``(window
    number, record)`` pairs in order, the record 0-based among the file's records. A file
    with no valid event time gives none; a record whose event time is missing while the
    format has the column is a bad line and counts as none."""
    from ctr_lightning.datamodules.stream_dataset import LogStreamDataset  # it imports this module's users

    # Only whole records are cut: a break in the file is the training pass's to report
    # (bad_files), in the slice whose last part holds it.
    dataset = LogStreamDataset([index.path], log_format, batch_size=1 << 16, files=[replace(index, unreadable=None)],
                               numbered=True, partition_time=partition_time, bad_files="skip")
    out: list[tuple[int, int]] = []
    newest: int | None = None
    whole = FileSlice(index.path, 0, index.records, index.header_lines, index.marks)
    for rows in dataset._read_slice(whole, BadLineLog()):
        if rows.event_time is None:
            raise ValueError(f"{index.path}: slice_every cuts time slices by each record's event time, but "
                             f"{type(log_format).__name__} reads none: set the reader's event_time_column (or "
                             f"partition_time=True for Hive dt=/hour= partitions)")
        wins = np.maximum.accumulate(rows.event_time // window)
        if newest is not None:
            wins = np.maximum(wins, newest)
        before = wins[0] - 1 if newest is None else newest
        for i in np.flatnonzero(np.diff(wins, prepend=before)):
            out.append((int(wins[i]), int(rows.records[i])))
        newest = int(wins[-1])
    return out


def cut_event_time_slices(files: Sequence[FileIndex], log_format: LogFormat, window: int, settings: str,
                          partition_time: bool = False, cache_dir: str | None = None) -> list[EventTimeSlice]:
    """The files' records cut into windows of ``window`` seconds of event time, in read
    order (see the module's docstring). ``settings`` names the reader's settings in the
    cache key: a reader that accepts other lines cuts elsewhere."""
    if window < 1:
        raise ValueError(f"slice_every must be at least one second, got {window}")
    cache = _WindowCache(cache_dir, window, settings, partition_time)
    bounds: list[tuple[int, str, int, int]] = []  # (window, path's position in files, first record, stop)
    current: int | None = None
    pending: list[tuple[int, int, int]] = []  # records read before any event time: the first slice's
    for n, index in enumerate(files):
        windows = cache.get(index, lambda: file_windows(index, log_format, window, partition_time))
        begin = 0
        for win, record in windows:
            if current is not None and win <= current:
                continue  # still the window a record of an earlier file reached
            if current is None:
                current = win
                continue
            if record > begin:
                bounds.append((current, n, begin, record))
            current, begin = win, record
        # A file that breaks off keeps a part, if only an empty one, to carry the break.
        if index.records > begin or index.unreadable is not None:
            if current is None:
                pending.append((n, begin, index.records))
            else:
                bounds.append((current, n, begin, index.records))
    if current is None:
        names = [f.path for f in files]
        raise ValueError(f"slice_every: no record of {names} has a valid event time")
    slices: dict[int, list[FileIndex]] = {}
    for n, first, stop in pending:
        slices.setdefault(bounds[0][0] if bounds else current, []).append(_part(files[n], first, stop))
    for win, n, first, stop in bounds:
        slices.setdefault(win, []).append(_part(files[n], first, stop))
    return [EventTimeSlice(win * window, tuple(parts)) for win, parts in slices.items()]


def _part(index: FileIndex, first: int, stop: int) -> FileIndex:
    # A break in the file (bad_files) lies after its last part only.
    return replace(index, first=index.first + first, records=stop - first,
                   unreadable=index.unreadable if stop == index.records else None)


class _WindowCache:
    """Each file's :func:`file_windows`, beside its row index in the cache directory."""

    def __init__(self, directory: str | None, window: int, settings: str, partition_time: bool) -> None:
        self.rows = RowIndexCache(directory)
        self.salt = json.dumps([_VERSION, window, settings, partition_time])

    def get(self, index: FileIndex, compute) -> list[tuple[int, int]]:
        key = self.rows.key_of(index.path) if self.rows.directory is not None else None
        if key is None:
            return compute()
        name = hashlib.sha1((key + self.salt).encode()).hexdigest()
        path = Path(self.rows.directory) / f"{name}.windows.json"
        try:
            return [tuple(pair) for pair in json.loads(path.read_text())]
        except (OSError, ValueError, TypeError):
            pass
        windows = compute()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(windows))
            tmp.replace(path)
        except OSError as e:
            log.warning("row index cache %s is not writable (%s); event-time slices are cut again next time",
                        self.rows.directory, e)
        return windows
