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


class LogCleaner:
    """Keeps an SSD log's files within about ``1 + max_garbage`` times its live records.

    While the sealed segments hold more than ``1 + max_garbage`` times their live records,
    the one with the least live share is cleaned: its live records are appended anew (by
    ``append``, which points the index at them) and the file is retired. A call moves at
    most ``budget`` records, and a cleaning left half done goes on at the next call, so no
    write waits on a whole segment. Callers hold the log's lock.

    Example::

        cleaner = LogCleaner(files, index, log._append, max_garbage=0.3)
        moved = cleaner.clean(budget=2 * len(ids))  # after each write
    """

    def __init__(self, files: SegmentFiles, index: LocationIndex, append: Append, max_garbage: float) -> None:
        self.files = files
        self.index = index
        self.append = append
        self.max_garbage = max_garbage
        self.cleaning: tuple[int, int] | None = None  # (segment, next slot) of a cleaning under way
        self.records_moved = 0

    def garbage_over(self) -> bool:
        sealed = self.files.sealed()
        written = sum(s.written for s in sealed)
        live = sum(s.live for s in sealed)
        return written > (1 + self.max_garbage) * live and written > 0

    def clean(self, budget: int) -> Relocated:
        """Move up to ``budget`` live records out of the emptiest segments while garbage is over."""
        files = self.files
        moved: list[Relocated] = []
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
