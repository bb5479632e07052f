"""Every stored row once, its freshest copy: for table snapshots and state dicts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ctr_lightning.embedding.tiers.key_index import KeyIndex
from ctr_lightning.embedding.tiers.row_cache import RowCache
from ctr_lightning.embedding.tiers.ssd.ssd_tier import Entries, SsdTier
from ctr_lightning.embedding.tiers.ssd_writer import SsdWriter

if TYPE_CHECKING:
    from ctr_lightning.embedding.snapshots.segment_sets import SegmentSetWriter

# Rows a chunk: (tables, ids, rows [n, width]).
Chunks = Iterator[tuple[np.ndarray, np.ndarray, torch.Tensor]]


class RowExport:
    """Reads every stored row of a tier stack once, its freshest copy first: the device
    tier, the host tier, the rows of a failed SSD write, then the SSD records no copy in
    memory shadows. Remembers where the last snapshot stood (:meth:`mark_saved`), so that
    the next one may hold only the rows changed since.

    Example::

        export = RowExport(device_tier, host_tier, ssd, writer, width=24)
        for tables, ids, rows in export.chunks(changed_only=True):
            ...
        export.mark_saved()
    """

    def __init__(self, device_tier: RowCache, host_tier: RowCache | None, ssd: SsdTier | None,
                 writer: SsdWriter, width: int) -> None:
        self.device_tier, self.host_tier, self.ssd = device_tier, host_tier, ssd
        self.writer = writer
        self.width = width
        self._saved_mark: Any = None  # where the SSD tier stood at the last snapshot (None: none yet)

    def all(self) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """``(tables, ids, rows)`` of every stored row, its freshest copy, all at once."""
        chunks = list(self.chunks())
        if not chunks:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), torch.empty(0, self.width)
        return (np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]),
                torch.cat([c[2] for c in chunks]))

    def chunks(self, chunk_rows: int = 1 << 16, changed_only: bool = False,
               share: SegmentSetWriter | None = None) -> Chunks:
        """Every stored row once, its freshest copy, a chunk at a time: the memory tiers'
        rows first, then the SSD records no copy in memory shadows. Memory held: one chunk
        and the keys of the memory tiers, not the table.

        With ``share`` (an SSD log on the file system of the snapshot being written), the
        records of sealed segments are not yielded: the segments are handed to ``share``
        (hard-linked), with the records that belong; only the segment being filled is read.

        With ``changed_only`` (after :meth:`mark_saved`), a superset of the rows changed
        since the mark: rows of the memory tiers written since (their ``changed`` flag: set
        by training, carried down when a row is demoted to the host tier) and SSD records
        written since that no dirty copy in memory shadows. A row that changed and left
        memory was written to SSD after the mark. Without an SSD tier every row is
        exported."""
        self.writer.drain()
        changed_only = changed_only and self.ssd is not None and self._saved_mark is not None
        shadow = KeyIndex()
        for tier, slots, give in self._memory_parts(changed_only):
            tables, ids = tier.keys_at(slots)
            fresh = shadow.lookup(tables, ids) < 0
            slots = slots[fresh]
            shadow.insert(tables[fresh], ids[fresh], np.zeros(int(fresh.sum()), dtype=np.int64))
            if not give:
                continue
            for start in range(0, len(slots), chunk_rows):
                rows = tier.rows_at(slots[start : start + chunk_rows])
                yield rows.tables, rows.ids, rows.values.cpu()
        # After the host tier: a failed write may hold an older copy of a row the host took since.
        if self.writer.unwritten is not None:
            part = self.writer.unwritten
            fresh = shadow.lookup(part.tables, part.ids) < 0
            shadow.insert(part.tables[fresh], part.ids[fresh], np.zeros(int(fresh.sum()), dtype=np.int64))
            if fresh.any():
                yield part.tables[fresh], part.ids[fresh], part.values[torch.from_numpy(np.flatnonzero(fresh))]
        if self.ssd is not None:
            yield from self._ssd_chunks(chunk_rows, changed_only, share, shadow)

    def _memory_parts(self, changed_only: bool) -> list[tuple[RowCache, np.ndarray, bool]]:
        """(tier, slots, whether given) in freshest-first order: a row given is skipped in
        later parts, and so is one held back. Rows are copied a chunk at a time, so the
        memory tiers' values are never duplicated whole."""
        parts: list[tuple[RowCache, np.ndarray, bool]] = []
        for tier in (self.device_tier, self.host_tier):
            if tier is None:
                continue
            slots = tier.held_slots()
            if changed_only:
                # A dirty row unchanged since the mark is in the snapshot chain already, and
                # any SSD record of it written since (a cleaning moved it) is older: hold it back.
                parts.append((tier, slots[tier.changed[slots]], True))
                parts.append((tier, slots[tier.dirty[slots] & ~tier.changed[slots]], False))
            elif tier is self.device_tier and (self.host_tier is not None or self.ssd is not None):
                parts.append((tier, slots[tier.dirty[slots]], True))  # a clean copy is another tier's row
            else:
                parts.append((tier, slots, True))
        return parts

    def _ssd_chunks(self, chunk_rows: int, changed_only: bool, share: SegmentSetWriter | None,
                    shadow: KeyIndex) -> Chunks:
        """The SSD tier's rows no copy in memory shadows; sealed segments go to ``share``."""
        mark = self._saved_mark if changed_only else None
        if share is not None and self.ssd.shares_segments:
            for sealed in self.ssd.sealed(mark):
                shadowed = shadow.lookup(sealed.keys["table"], sealed.keys["id"]) >= 0 if len(shadow) else False
                if not share.add(sealed, sealed.live & ~shadowed):  # no link possible: its rows instead
                    yield from _unshadowed(self.ssd.segment_entries(sealed.number, chunk_rows), shadow)
            records = self.ssd.active_entries(mark, chunk_records=chunk_rows)
        elif changed_only:
            records = self.ssd.entries_since(self._saved_mark, chunk_records=chunk_rows)
        else:
            records = self.ssd.entries(chunk_records=chunk_rows)
        yield from _unshadowed(records, shadow)

    def mark_saved(self) -> None:
        """The stored rows are in a snapshot now (saved, or just loaded from one): the next
        ``chunks(changed_only=True)`` starts from here."""
        self.writer.drain()
        self._saved_mark = self.ssd.mark() if self.ssd is not None else None
        for tier in (self.device_tier, self.host_tier):
            if tier is not None:
                tier.changed[:] = False

    def forget_mark(self) -> None:
        """No snapshot holds the stored rows (they are about to be replaced)."""
        self._saved_mark = None


def _unshadowed(records: Entries, shadow: KeyIndex) -> Chunks:
    """SSD records of rows no copy in memory shadows."""
    for tables, ids, data in records:
        keep = shadow.lookup(tables, ids) < 0 if len(shadow) else np.ones(len(ids), dtype=bool)
        if keep.any():
            yield tables[keep], ids[keep], torch.from_numpy(data[keep])
