"""The cleaning of an SSD log: garbage records removed a piece at a time, after writes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ctr_lightning.embedding.tiers.ssd.location_index import LocationIndex
from ctr_lightning.embedding.tiers.ssd.ssd_log_segments import BACKGROUND_READ_MIN, HEADER_WORDS, SegmentFiles, record_keys
from ctr_lightning.embedding.tiers.ssd.ssd_tier import Relocated
from ctr_lightning.fault_points import reached

# Appends rows ``(tables, ids, rows, old locations)`` to the log: their new locations.
Append = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
# Per table, the floor below which rows are gone (see RowExpiry); None while rows never expire.
Floors = Callable[[], "np.ndarray | None"]
# Each record's rank key, which the floor applies to: ``(tables, rows) -> int64`` (RowExpiry.rank_keys).
Rank = Callable[[np.ndarray, np.ndarray], np.ndarray]


class LogCleaner:
    """Keeps an SSD log's files within about ``1 + max_garbage`` times its live records.

    While the sealed segments hold more than ``1 + max_garbage`` times their live records,
    the one with the least live share is cleaned: its live records are appended anew (by
    ``append``, which points the index at them) and the file is retired. A call moves at
    most ``budget`` records, and a cleaning left half done goes on at the next call, so no
    write waits on a whole segment. Callers hold the log's lock.

    Where rows expire (``floors``, and each row's rank key: ``rank``, its last lookup step or
    its score's bucket), this
    is where their records are deleted: a cleaning drops the records of rows gone instead of
    moving them, and each call first retires sealed segments whose
    every record is of a row gone, up to ``budget`` records of them (from their keys files
    alone; the records are not read). Rows dropped are reported with location -1: a copy in memory has no SSD
    record any more.

    Example::

        cleaner = LogCleaner(files, index, log._append, max_garbage=0.3)
        moved = cleaner.clean(budget=2 * len(ids))  # after each write
    """

    def __init__(self, files: SegmentFiles, index: LocationIndex, append: Append, max_garbage: float,
                 floors: Floors | None = None, rank: Rank | None = None) -> None:
        self.files = files
        self.index = index
        self.append = append
        self.max_garbage = max_garbage
        self.floors: Floors = floors if floors is not None else (lambda: None)
        self.rank = rank
        self.cleaning: tuple[int, int] | None = None  # (segment, next slot) of a cleaning under way
        self.records_moved = 0
        self.records_dropped = 0  # records of rows gone, deleted

    def garbage_over(self) -> bool:
        sealed = self.files.sealed()
        written = sum(s.written for s in sealed)
        live = sum(s.live for s in sealed)
        return written > (1 + self.max_garbage) * live and written > 0

    def clean(self, budget: int) -> Relocated:
        """Move up to ``budget`` live records out of the emptiest segments while garbage is over."""
        files = self.files
        floors = self.floors()
        moved: list[Relocated] = [self._retire_gone_segments(floors, budget)] if floors is not None else []
        while budget > 0 and (self.cleaning is not None or self.garbage_over()):
            if self.cleaning is None:
                victim = min(files.sealed(), key=lambda s: (s.live / max(s.written, 1), s.number))
                self.cleaning = (victim.number, 0)
            number, slot = self.cleaning
            victim = files.segments[number]
            take = min(budget, victim.written - slot, 1 << 16)
            slots = np.arange(slot, slot + take, dtype=np.int64)
            locations = number * files.segment_records + slots
            records = files.read(locations, {number: victim.fd}, BACKGROUND_READ_MIN)
            tables, ids = record_keys(records)
            live = self.index.is_current(tables, ids, locations)
            if floors is not None and live.any():
                drop = live & (self.rank(tables, records[:, HEADER_WORDS:]) < floors[tables])
                moved.append(self._drop(tables[drop], ids[drop], locations[drop]))
                live &= ~drop
            if live.any():
                new = self.append(tables[live], ids[live], records[live, HEADER_WORDS:], locations[live])
                moved.append(Relocated(tables[live], ids[live], new))
                self.records_moved += int(live.sum())
                reached("ssd_clean")
            budget -= max(take, 1)
            if slot + take >= victim.written:
                files.retire(victim)
                self.cleaning = None
            else:
                self.cleaning = (number, slot + take)
        return Relocated.latest(moved)

    def _drop(self, tables: np.ndarray, ids: np.ndarray, locations: np.ndarray) -> Relocated:
        """Delete live records of rows gone: the index forgets them."""
        self.index.remove(tables, ids, locations)
        self.files.count_live(locations, -1)
        self.records_dropped += len(ids)
        return Relocated(tables, ids, np.full(len(ids), -1, dtype=np.int64))

    def _retire_gone_segments(self, floors: np.ndarray, budget: int) -> Relocated:
        """Retire sealed segments that hold only rows gone (by their newest record of each
        table), their records up to ``budget`` in all and at least one segment; their live
        records are dropped. At twice a write's records a call, retiring outpaces sealing,
        so segments of rows gone cannot pile up however the floors and the writes interleave."""
        busy = self.cleaning[0] if self.cleaning is not None else -1
        dropped: list[Relocated] = []
        for segment in self.files.sealed():
            if budget <= 0:
                break
            if segment.newest is None or segment.number == busy or not (segment.newest < floors).all():
                continue
            keys = self.files.sealed_keys(segment, durable=False)
            tables, ids = keys["table"].astype(np.int64), keys["id"].astype(np.int64)
            locations = segment.number * self.files.segment_records + np.arange(len(keys), dtype=np.int64)
            live = self.index.is_current(tables, ids, locations)
            if live.any():
                dropped.append(self._drop(tables[live], ids[live], locations[live]))
            self.files.retire(segment)
            budget -= max(len(keys), 1)
        return Relocated.latest(dropped)
