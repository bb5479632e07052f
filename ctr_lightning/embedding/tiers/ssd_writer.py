"""Where rows leave DRAM for SSD: one write at a time, in a thread, while training goes on."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from ctr_lightning.embedding.tiers.key_index import dedup
from ctr_lightning.embedding.tiers.row_cache import RowCache, Rows
from ctr_lightning.embedding.tiers.ssd.ssd_tier import Relocated, SsdTier


class SsdWriter:
    """Writes the rows evicted from the lowest memory tier (the host tier, or the device
    tier where there is none) to the SSD tier. This is the one place where a row leaves
    DRAM for SSD.

    A write runs in a thread (:meth:`write_behind`); anything that reads or writes the SSD
    tier first waits for it (:meth:`drain`), and the memory tiers then learn where rows
    moved: the SSD copies of the rows written, and of rows a cleaning moved meanwhile.
    A write that fails (a full disk: ENOSPC) raises at that :meth:`drain`; its rows stay
    readable here (:meth:`unwritten_rows`), and :meth:`check_usable` refuses training
    from then on, until a load replaces every row (:meth:`reset`).

    Example::

        writer = SsdWriter(ssd, ["t0"], [device_tier, host_tier])
        writer.write_behind(victims)  # returns at once
        writer.drain()                # done; the memory tiers know the new locations
    """

    def __init__(self, ssd: SsdTier | None, names: list[str], memory_tiers: list[RowCache]) -> None:
        self.ssd = ssd
        self.names = names
        self.memory_tiers = memory_tiers  # the tiers whose copies follow a row's SSD record
        self.wait_us = 0
        self._thread: ThreadPoolExecutor | None = None
        self._pending: tuple[Future, Rows] | None = None
        self.unwritten: Rows | None = None  # rows a failed write left here, still readable
        self.failed: BaseException | None = None  # that failure: no training (no writes) after it

    def write(self, rows: Rows) -> Relocated:
        """Store rows on SSD now; returns the rows whose SSD record moved."""
        if not len(rows):
            return Relocated()
        self._require_ssd()
        return self._store(rows)

    def write_behind(self, rows: Rows) -> None:
        """Store rows on SSD in the thread, after the write under way; its moves reach the
        memory tiers with :meth:`drain`."""
        if not len(rows):
            return
        self._require_ssd()
        self.drain()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctr-ssd-write")
        self._pending = (self._thread.submit(self._store, rows), rows)

    def _require_ssd(self) -> None:
        if self.ssd is None:
            raise RuntimeError(f"tables {self.names}: rows must leave memory but no SSD tier is configured")

    def _store(self, rows: Rows) -> Relocated:
        locations, moved = self.ssd.write(rows.tables, rows.ids, rows.values.cpu().numpy(), rows.locations)
        # The device tier may hold a copy of a row the host tier wrote (the tiers are
        # inclusive): that copy's SSD record is the new one now.
        return Relocated.latest([Relocated(rows.tables, rows.ids, locations), moved])

    def wait_for_write(self) -> None:
        """Wait until the SSD write under way is done (any thread; its moves reach the
        memory tiers with the training thread's next :meth:`drain`)."""
        pending = self._pending
        if pending is not None:
            wait([pending[0]])

    def drain(self) -> None:
        """Wait for the SSD write under way; copies in memory learn where rows moved. A
        failed write raises here, and its rows stay readable (:meth:`unwritten_rows`)."""
        if self._pending is None:
            return
        future, rows = self._pending
        start = time.perf_counter()
        try:
            moved = future.result()
        except BaseException as e:
            if not future.done():
                raise  # interrupted while waiting (Ctrl-C): the write goes on, still pending
            # Cleared only once done: until then a prefetch thread must see it under way.
            self._pending = None
            # Kept readable. Nothing writes after a failure (fetch refuses), so this is the
            # only one, no newer copy can appear on SSD, and stale SSD locations go unused.
            self.unwritten = Rows(rows.tables, rows.ids, rows.values.cpu(), rows.dirty, rows.locations)
            self.failed = e
            raise
        finally:
            self.wait_us += int((time.perf_counter() - start) * 1e6)
        self._pending = None
        if len(moved.ids):
            for tier in self.memory_tiers:
                tier.relocate(moved.tables, moved.ids, moved.locations)

    def check_usable(self) -> None:
        """Refuse training after a failed write: its rows are readable, not writable."""
        if self.failed is not None:
            raise RuntimeError(f"tables {self.names}: an SSD write failed earlier ({self.failed}); the rows it "
                               f"held are still readable (rows(), a checkpoint), but training cannot go on: "
                               f"resume from the last checkpoint") from self.failed

    def unwritten_rows(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """``(hit mask, rows [hits, width])`` of these rows held by a failed write."""
        unwritten = self.unwritten
        if unwritten is None:
            return np.zeros(len(ids), dtype=bool), torch.empty(0)
        first, inverse = dedup(np.concatenate([unwritten.tables, tables]), np.concatenate([unwritten.ids, ids]))
        where = first[inverse[len(unwritten):]]  # a row of unwritten, or the query itself
        hit = where < len(unwritten)
        return hit, unwritten.values[torch.from_numpy(where[hit])]

    def reset(self) -> None:
        """Forget a failed write (and its rows): every stored row is about to be replaced."""
        try:
            self.drain()
        except OSError:
            pass  # a write that failed before: whatever it held is replaced now
        self.unwritten = self.failed = None
