"""The rows upcoming batches need: until when each is needed, and those read ahead from SSD."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ctr_lightning.embedding.prefetch.staging import StagedChunk, StagedRows
from ctr_lightning.embedding.tiers.key_index import KeyIndex

if TYPE_CHECKING:
    from ctr_lightning.embedding.tiers.row_cache import RowCache
    from ctr_lightning.embedding.tiers.ssd.direct_store import DirectSsdStore
    from ctr_lightning.embedding.tiers.ssd.ssd_log import SsdLog


class WorkingSet:
    """Read-ahead state of one table group, driven by :class:`WorkingSetPrefetcher`.

    Batches are registered in increasing order before they run. Rows already in the
    device tier are marked with the last upcoming batch that needs them (eviction spares
    them); the others are noted in :attr:`upcoming`, marked when they arrive
    (:meth:`arrived`), and read from SSD into :attr:`staged` by a background thread
    (:meth:`stage`), from where a batch's misses are served as long as their SSD copy has
    not changed since. It also remembers the dedup of registered batches, so their lookup
    need not do it again. It alone writes the device tier's ``needed_until`` marks
    (besides the tier resetting a slot it reuses).

    Example::

        working_set = WorkingSet()
        to_read = working_set.register(device_tier, host_tier, tables, ids, slots, batch=7)  # training thread
        working_set.stage(ssd, *to_read, batch=7)                                            # prefetch thread
        working_set.release(7)                                                               # batch 7 has run
    """

    def __init__(self) -> None:
        self.staged = StagedRows()
        self.upcoming = KeyIndex()  # (table, id) of rows not yet in memory -> last batch needing them
        self._registered: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._dedup: dict[int, tuple[np.ndarray, ...]] = {}
        self.current_batch: int | None = None  # the batch running now; None when not reading ahead
        self.counters = {"prefetch_hits": 0, "prefetched_rows": 0, "prefetch_bytes": 0, "prefetch_failures": 0,
                      "prefetch_stale": 0}

    # -- training thread ---------------------------------------------------------------------

    def register(self, device_tier: RowCache, host_tier: RowCache | None, tables: np.ndarray, ids: np.ndarray,
                 slots: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Note that ``batch`` needs these unique rows (``slots``: their device-tier slots,
        -1 where absent); returns those to read from SSD: in neither memory tier."""
        if self.current_batch is None:
            self.current_batch = batch
        present = slots >= 0
        device_tier.needed_until[slots[present]] = batch
        # Rows not in the device tier get their batch noted, to be spared once they arrive.
        tables, ids = tables[~present], ids[~present]
        self.upcoming.insert(tables, ids, np.full(len(ids), batch, dtype=np.int64))
        self._registered[batch] = (tables, ids)
        if host_tier is not None:
            in_host = host_tier.lookup(tables, ids) >= 0
            tables, ids = tables[~in_host], ids[~in_host]
        return tables, ids

    def arrived(self, device_tier: RowCache, tables: np.ndarray, ids: np.ndarray, slots: np.ndarray) -> None:
        """These rows just came into the device tier at ``slots``: spare each until the last
        registered batch that needs it (-1: none)."""
        device_tier.needed_until[slots] = self.needed_until(tables, ids)

    def needed_until(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The last registered batch that needs each row (-1: none)."""
        return self.upcoming.lookup(tables, ids) if len(self.upcoming) else np.full(len(ids), -1, dtype=np.int64)

    def take(self, tables: np.ndarray, ids: np.ndarray,
             ssd: SsdLog | DirectSsdStore) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
        """``(found, rows, locations)`` of these rows read ahead whose SSD copy is still current."""
        found, rows, locations, stale = self.staged.take(tables, ids, ssd.tokens)
        self.counters["prefetch_stale"] += stale
        self.counters["prefetch_hits"] += int(found.sum())
        return found, rows, locations

    def release(self, batch: int) -> None:
        """``batch`` has run: drop what was read ahead for it and its spared rows."""
        self.current_batch = batch + 1
        self.staged.release(batch)
        for b in [b for b in self._registered if b <= batch]:
            tables, ids = self._registered.pop(b)
            last = self.upcoming.lookup(tables, ids)
            done = last <= batch
            self.upcoming.remove(tables[done], ids[done])

    def stop(self) -> None:
        """Back to fetching on demand only."""
        self.current_batch = None
        self.staged.clear()
        self.upcoming.clear()
        self._registered.clear()
        self._dedup.clear()

    def remember_dedup(self, tables: np.ndarray, ids: np.ndarray, first: np.ndarray, inverse: np.ndarray) -> None:
        """Keep the dedup of these very arrays for their lookup (keyed by the ids' memory)."""
        self._dedup[ids.ctypes.data] = (tables, ids, first, inverse)
        while len(self._dedup) > 64:  # batches read ahead but never looked up (evaluation)
            self._dedup.pop(next(iter(self._dedup)))

    def remembered_dedup(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(first, inverse)`` remembered for arrays equal to these, once; else None."""
        cached = self._dedup.pop(ids.ctypes.data, None) if self._dedup else None
        if (cached is not None and len(cached[1]) == len(ids) and np.array_equal(cached[1], ids)
                and np.array_equal(cached[0], tables)):
            return cached[2], cached[3]
        return None

    # -- prefetch thread ---------------------------------------------------------------------

    def stage(self, ssd: SsdLog | DirectSsdStore, tables: np.ndarray, ids: np.ndarray, batch: int) -> None:
        """Read the SSD copies of these rows into DRAM for ``batch``."""
        if not len(ids):
            return
        locations, tokens, pinned = ssd.locate(tables, ids)
        try:
            there = np.flatnonzero(locations >= 0)
            ok, rows = ssd.read_located(tables[there], ids[there], locations[there], pinned)
        except OSError:
            self.counters["prefetch_failures"] += 1  # those rows come on demand
            return
        finally:
            ssd.release(pinned)
        there = there[ok]
        self.staged.put(StagedChunk(batch, tables[there], ids[there], tokens[there], locations[there], rows))
        self.counters["prefetched_rows"] += len(rows)
        self.counters["prefetch_bytes"] += rows.nbytes
