"""Replacing every stored row: from a state dict, a table snapshot's rows, or its SSD segments."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ctr_lightning.embedding.snapshots.segment_sets import SegmentSet, segment_keys
from ctr_lightning.embedding.tiers.group_tables import GroupTables
from ctr_lightning.embedding.tiers.row_cache import RowCache, Rows
from ctr_lightning.embedding.tiers.ssd.ssd_tier import SsdTier
from ctr_lightning.embedding.tiers.ssd_writer import SsdWriter


class RowLoad:
    """Loads the rows of a tier stack: :meth:`begin` forgets every stored row, then
    :meth:`chunk` stores rows (on SSD when there is one, else in memory) and :meth:`adopt`
    takes a snapshot's SSD segments by hard link. Loading a chain of incremental snapshots
    goes newest first, each older one with ``older``: keys loaded already are skipped.

    Example::

        load = RowLoad(tables, device_tier, host_tier, ssd, writer)
        load.begin()
        left = load.adopt(segment_set)          # the segments it could not link ...
        load.chunk(tables, ids, rows)           # ... are loaded row by row
    """

    def __init__(self, tables: GroupTables, device_tier: RowCache, host_tier: RowCache | None,
                 ssd: SsdTier | None, writer: SsdWriter) -> None:
        self.tables = tables
        self.device_tier, self.host_tier, self.ssd = device_tier, host_tier, ssd
        self.writer = writer

    def begin(self) -> None:
        """Forget every stored row, before :meth:`chunk` and :meth:`adopt` calls."""
        self.writer.reset()
        self.device_tier.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.ssd is not None:
            self.ssd.clear()

    def chunk(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor, older: bool = False) -> None:
        """Store rows (keys new since :meth:`begin`): on SSD when there is one, else in
        memory. With ``older``, rows of keys loaded already are skipped: they came from a
        newer snapshot (loading a chain of incremental ones, newest first)."""
        self.tables.check_ids(tables, ids)
        if older and len(ids):
            self.writer.drain()
            if self.ssd is not None:
                present = self._present(tables, ids)
            else:
                tier = self.host_tier if self.host_tier is not None else self.device_tier
                present = tier.lookup(tables, ids) >= 0
            if present.any():
                keep = np.flatnonzero(~present)
                tables, ids, rows = tables[keep], ids[keep], rows[torch.from_numpy(keep)]
        loaded = Rows(tables, ids, rows, np.ones(len(ids), dtype=bool))
        if self.ssd is not None:
            self.writer.write(loaded)  # the memory tiers are empty: no copy to relocate
        elif self.host_tier is not None:
            self.host_tier.insert(loaded)
        else:
            self.device_tier.insert(loaded)

    def adopt(self, segment_set: SegmentSet, keep: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
              older: bool = False) -> list[int]:
        """Take the segments of a snapshot's segment set into the SSD log by hard link (no
        row copied), their records that belong to the set and that ``keep`` (a function
        of ``(tables, ids)`` giving a mask) selects; with ``older``, keys loaded already are
        skipped (see :meth:`chunk`). Returns the segments it could not take (another
        record layout or file system): the caller loads their rows instead."""
        if self.ssd is None or not self.ssd.shares_segments or segment_set.tables != self.tables.names:
            return list(range(len(segment_set.segments)))
        self.writer.drain()
        left, refused = [], False
        for n, segment in enumerate(segment_set.segments):
            if refused or not self.ssd.can_adopt(segment_set.record_bytes, segment.records):
                left.append(n)
                continue
            keys = segment_keys(segment_set, segment)
            tables, ids = keys["table"].astype(np.int64), keys["id"]
            take = segment.take
            if keep is not None and take.any():
                take[take] = keep(tables[take], ids[take])
            if older and take.any():
                where = np.flatnonzero(take)
                take[where[self._present(tables[where], ids[where])]] = False
            if not take.any():
                continue
            self.tables.check_ids(tables[take], ids[take])
            folder = segment_set.path.parent
            newest = np.array(segment.newest, dtype=np.int64) if segment.newest is not None else None
            if not self.ssd.adopt(folder / segment.file, folder / segment.keys, segment.records, segment.crc32, keys,
                                  take, newest):
                left.append(n)
                refused = True  # no hard link from this snapshot to this SSD directory
        return left

    def _present(self, tables: np.ndarray, ids: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
        """Which keys the SSD tier holds already, exactly: keys it may hold (none: absent)
        are checked against their records (an index's hash may name another key), a chunk
        at a time."""
        present = np.zeros(len(ids), dtype=bool)
        candidates = np.flatnonzero(self.ssd.may_hold(tables, ids))
        for start in range(0, len(candidates), chunk):
            part = candidates[start : start + chunk]
            present[part] = self.ssd.read(tables[part], ids[part])[0]
        return present
