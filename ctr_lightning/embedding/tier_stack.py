"""Where the rows of a table group live (device tier, host tier, SSD) and how they move."""

from __future__ import annotations

import gc
import itertools
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.initializer import initial_rows, initialize_slots, range_bounds, table_key
from ctr_lightning.embedding.key_index import KeyIndex, dedup
from ctr_lightning.embedding.row_cache import RowCache, Rows, TierFull
from ctr_lightning.embedding.segment_sets import SegmentSet, SegmentSetWriter, segment_keys
from ctr_lightning.embedding.ssd import DirectSsdStore
from ctr_lightning.embedding.ssd_log import NO_SSD_COUNTERS, Relocated, SsdLog
from ctr_lightning.embedding.table_setup import TableSetup, has_host_tier

if TYPE_CHECKING:
    from ctr_lightning.embedding.working_set import WorkingSet

_RESERVE_BYTES = 4 << 30


class TierStack:
    """The tiers of a few tables that share a row layout: ``[weights | optimizer state]``.

    The device tier is the one the compute reads; misses come from the host tier, then
    the SSD tier (or rows read ahead from it), then the counter-based initializer. Evicted
    dirty rows go one tier down; clean ones are dropped, since the tier below (or the
    initializer) already has them.

    Example::

        tiers = TierStack("dim64", tables, setup)
        slots = tiers.fetch(tables_of_misses, ids_of_misses, pinned=slots_of_hits)
        tiers.full_rows(tables, ids)     # freshest copy of each row, read only
    """

    def __init__(self, name: str, tables: list[EmbeddingBagConfig], setup: TableSetup) -> None:
        self.names = [t.name for t in tables]
        self.dim = tables[0].embedding_dim
        self.width = setup.row_width(self.dim)
        self.seed = setup.seed
        self.table_keys = np.array([table_key(t.name) for t in tables], dtype=np.int64)
        self.num_embeddings = np.array([t.num_embeddings for t in tables], dtype=np.int64)
        self.bounded = np.array([setup.id_space[t.name] == "bounded" for t in tables], dtype=bool)
        # Per table, the half width and middle of the uniform range its rows start in.
        self.init_bounds, self.init_centers = range_bounds(*np.array([setup.init_range[t.name] for t in tables]).T)
        storage = [setup.storage[t.name] for t in tables]
        lfu = [s.eviction == "lfu" for s in storage]
        device_caps, host_caps = setup.capacities(tables)
        # Unbounded tiers reserve address space for every row the configs expect (never more
        # than _RESERVE_BYTES); untouched pages of the reservation cost no memory.
        reserve = int(min(self.num_embeddings.sum(), _RESERVE_BYTES // (self.width * 4)))
        self.device_tier = RowCache(self.width, device_caps, lfu, setup.device, reserve_rows=reserve)
        self.host_tier = (RowCache(self.width, host_caps, lfu, "cpu", reserve_rows=reserve)
                          if has_host_tier(device_caps, host_caps) else None)
        ssd_dir = storage[0].ssd_dir
        self.ssd: SsdLog | DirectSsdStore | None = None
        if ssd_dir is not None and self.bounded.all():
            self.ssd = DirectSsdStore(ssd_dir, name, self.width, self.names, list(self.num_embeddings))
        elif ssd_dir is not None:
            self.ssd = SsdLog(ssd_dir, name, self.width, self.names, segment_bytes=storage[0].ssd_segment_bytes)
        self.stats = {"device_hits": 0, "host_hits": 0, "ssd_hits": 0, "new_rows": 0, "ssd_stall_us": 0}
        # Device slots of training forwards whose backward is to come, by pin number. A dict:
        # a pin may be released from whichever thread frees its forward's autograd graph,
        # and one dict operation is atomic under the GIL.
        self._pins: dict[int, np.ndarray] = {}
        self._pin_numbers = itertools.count()
        self._evict_us = self._wait_us = 0
        # Evicted rows are written to SSD by a thread while training goes on; anything that
        # reads or writes the SSD tier first waits for that write (drain).
        self._writer: ThreadPoolExecutor | None = None
        self._pending: tuple[Future, Rows] | None = None
        self._unwritten: Rows | None = None  # rows a failed write left here, still readable
        self._failed: BaseException | None = None  # that failure: no training (no writes) after it
        self._saved_mark: Any = None  # where the SSD tier stood at the last snapshot (None: none yet)

    def counters(self) -> dict[str, int]:
        """Microseconds spent making room in the device tier (choosing victims, handing
        them down), waiting for the SSD writes under way, and the SSD tier's own
        :meth:`SsdLog.counters` (its writes run in a thread)."""
        ssd = self.ssd.counters() if self.ssd is not None else NO_SSD_COUNTERS
        return {"evict_us": self._evict_us, "ssd_wait_us": self._wait_us, **ssd}

    def storage_stats(self) -> dict[str, int]:
        """What the tiers hold now: rows and bytes on SSD (on disk and live), the SSD index's
        bytes, and the bytes of the memory tiers (device tier counted when in host memory)."""
        self.drain()
        stats = {"ssd_rows": 0, "ssd_bytes": 0, "ssd_live_bytes": 0, "ssd_index_bytes": 0,
                 "memory_rows": len(self.device_tier) + (len(self.host_tier) if self.host_tier is not None else 0),
                 "dram_bytes": self.host_tier.nbytes if self.host_tier is not None else 0}
        if self.device_tier.device.type == "cpu":
            stats["dram_bytes"] += self.device_tier.nbytes
        if self.ssd is not None:
            stats.update(ssd_rows=len(self.ssd), ssd_bytes=self.ssd.disk_bytes, ssd_live_bytes=self.ssd.live_bytes,
                         ssd_index_bytes=self.ssd.index_bytes)
            stats["dram_bytes"] += self.ssd.index_bytes
        return stats

    def check_ids(self, tables: np.ndarray, ids: np.ndarray) -> None:
        """An error naming the table and id of the first id its table cannot hold."""
        if not self.bounded.any() and (not len(ids) or ids.min() >= 0):
            return  # the common case, hashed ids: only the sign to check
        bad = ids < 0
        bad |= self.bounded[tables] & (ids >= self.num_embeddings[tables])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            t = int(tables[i])
            why = "negative" if ids[i] < 0 else f"outside [0, {int(self.num_embeddings[t])})"
            raise ValueError(f"table {self.names[t]!r}: id {int(ids[i])} is {why}")

    def move_device_tier(self, device: torch.device) -> None:
        self.device_tier.to(device)

    def pin(self, slots: np.ndarray, holder: object) -> Callable[[], None]:
        """Keep these device rows in place: a training forward's update is to come in its
        backward. Returns the release, which runs once: when called (the update is done) or
        when ``holder`` is garbage collected, whichever comes first. ``holder`` is an object
        only the forward's autograd graph keeps, so a forward whose backward never comes (a
        skipped batch, an exception before backward) gives its rows back when its output
        and graph are freed."""
        number = next(self._pin_numbers)
        self._pins[number] = slots
        release = weakref.finalize(holder, self._pins.pop, number, None)
        release.atexit = False  # nothing to give back at exit
        return release

    def _pinned(self) -> list[np.ndarray]:
        return list(self._pins.values())

    # -- misses ----------------------------------------------------------------------------

    def fetch(self, tables: np.ndarray, ids: np.ndarray, pinned: np.ndarray,
              working_set: WorkingSet | None = None) -> np.ndarray:
        """Bring rows absent from the device tier into it; returns their slots.

        Room is made by evicting rows that are neither ``pinned`` nor pinned by
        :meth:`pin` (and, with an active ``working_set``, rows an upcoming batch needs
        only as a last resort); rows read ahead are taken from it.
        """
        self.drain()
        if self._failed is not None:
            raise RuntimeError(f"tables {self.names}: an SSD write failed earlier ({self._failed}); the rows it "
                               f"held are still readable (rows(), a checkpoint), but training cannot go on: "
                               f"resume from the last checkpoint") from self._failed
        reading_ahead = working_set is not None and working_set.current_batch is not None
        rows = torch.empty(len(ids), self.width)
        locations = np.full(len(ids), -1, dtype=np.int64)  # where each row's SSD copy lies
        filled = np.zeros(len(ids), dtype=bool)
        if self.host_tier is not None:
            hslots = self.host_tier.lookup(tables, ids)
            hit = hslots >= 0
            if hit.any():
                rows[torch.from_numpy(np.flatnonzero(hit))] = self.host_tier.values[torch.from_numpy(hslots[hit])]
                locations[hit] = self.host_tier.ssd_location[hslots[hit]]
                filled |= hit
                self.stats["host_hits"] += int(hit.sum())
        if self.ssd is not None and not filled.all():
            rest = np.flatnonzero(~filled)
            if reading_ahead:
                found, data, where = working_set.take(tables[rest], ids[rest], self.ssd)
                if found.any():
                    rows[torch.from_numpy(rest[found])] = data
                    locations[rest[found]] = where
                    filled[rest[found]] = True
                    rest = rest[~found]
            start = time.perf_counter()
            found, data, where = self.ssd.read(tables[rest], ids[rest])
            self.stats["ssd_stall_us"] += int((time.perf_counter() - start) * 1e6)
            if found.any():
                rows[torch.from_numpy(rest[found])] = torch.from_numpy(data)
                locations[rest[found]] = where
                filled[rest[found]] = True
                self.stats["ssd_hits"] += int(found.sum())
        start = time.perf_counter()
        need = self.device_tier.room_needed(tables)
        victim_slots, victims = self._choose_victims(need, pinned, working_set.current_batch if reading_ahead else None)
        moved = self._demote(victims.select(victims.dirty))
        self.device_tier.release(victim_slots)
        self._evict_us += int((time.perf_counter() - start) * 1e6)
        clean = np.zeros(len(ids), dtype=bool)
        if filled.all():
            slots = self.device_tier.insert(Rows(tables, ids, rows, clean, locations))
        else:
            slots = np.empty(len(ids), dtype=np.int64)
            old, new = np.flatnonzero(filled), np.flatnonzero(~filled)
            if len(old):
                slots[old] = self.device_tier.insert(Rows(tables[old], ids[old], rows[torch.from_numpy(old)], clean[old],
                                                          locations[old]))
            # Rows never stored anywhere start from the initializer, written in place.
            slots[new] = self.device_tier.place(tables[new], ids[new], clean[new], absent=True)
            self._initialize(slots[new], tables[new], ids[new])
            self.stats["new_rows"] += len(new)
        if reading_ahead:
            self.device_tier.needed_until[slots] = working_set.needed_until(tables, ids)
        # Only now: the writes above may have moved the SSD copies of rows that were in
        # flight then (read for this batch, or demoted to the host tier).
        self._relocate(moved)
        return slots

    def _choose_victims(self, need: np.ndarray, pinned: np.ndarray,
                        needed_after: int | None) -> tuple[np.ndarray, Rows]:
        """Device rows to evict, sparing ``pinned`` (this batch's) and the rows of training
        forwards whose backward is to come."""
        for collected in (False, True):
            if collected:
                # Graphs kept alive only by reference cycles (a traceback, torchrec's all-to-all
                # requests) are freed by the cycle collector alone; their release comes with it.
                gc.collect()
            held = self._pinned()
            try:
                return self.device_tier.choose_victims(need, np.concatenate([pinned, *held]), self.names,
                                                       needed_after)
            except TierFull as full:
                if not held:
                    raise  # this batch alone is too big: the message says so
                if collected:
                    raise self._held_by_forwards(full, held) from None
        raise AssertionError("unreachable")

    def _held_by_forwards(self, full: TierFull, held: list[np.ndarray]) -> TierFull:
        """The error for a tier that rows of earlier forwards fill, not the batch (``full``
        itself when they hold none of that table's rows)."""
        code = self.device_tier.table_code
        by_forward = [slots[code[slots].astype(np.int64) - 1 == full.table] for slots in held]
        forwards = sum(1 for slots in by_forward if len(slots))
        rows = len(np.unique(np.concatenate(by_forward)))
        if not rows:
            return full
        return TierFull(
            f"table {self.names[full.table]!r}: the batches in flight touch more rows than its tier holds "
            f"({full.touched} rows, capacity {full.capacity} rows), {rows} of them held by {forwards} earlier training "
            f"forwards whose backward has not run. A training forward holds its rows until its backward, or until its "
            f"output (and anything computed from it, such as the loss) is freed: a step that skips backward must not "
            f"keep them. Several forwards before one backward (gradient accumulation, pipelining) need a tier that "
            f"holds all their rows: raise the capacity",
            full.table, full.touched, full.capacity)

    def _initial(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return initial_rows(self.seed, self.table_keys[tables], ids, self.dim, self.init_bounds[tables],
                            self.init_centers[tables])

    def _initialize(self, slots: np.ndarray, tables: np.ndarray, ids: np.ndarray) -> None:
        """Device-tier rows at ``slots`` := initial weights and zero optimizer state."""
        values = self.device_tier.values
        if values.device.type == "cpu":
            initialize_slots(self.seed, self.table_keys[tables], ids, self.dim, self.init_bounds[tables],
                             values.numpy(), slots, self.init_centers[tables])
            return
        rows = torch.zeros(len(ids), self.width)
        rows[:, : self.dim] = torch.from_numpy(self._initial(tables, ids))
        values[torch.from_numpy(slots).to(values.device)] = rows.to(values.device)

    def _demote(self, rows: Rows) -> Relocated:
        """Write dirty rows leaving the device tier into the host tier (or the SSD); returns
        the rows whose SSD copy a cleaning moved meanwhile, for the caller to
        :meth:`_relocate` once the rows in flight are in place."""
        if not len(rows):
            return Relocated()
        if self.host_tier is None:
            return self._write_ssd(rows, background=True)
        need = self.host_tier.room_needed(rows.tables)
        victim_slots, victims = self.host_tier.choose_victims(need, np.empty(0, dtype=np.int64), self.names)
        moved = self._write_ssd(victims.select(victims.dirty), background=True)
        self.host_tier.release(victim_slots)
        self.host_tier.insert(Rows(rows.tables, rows.ids, rows.values.cpu(), np.ones(len(rows), dtype=bool),
                                   rows.locations, rows.changed))
        return moved

    def _write_ssd(self, rows: Rows, background: bool = False) -> Relocated:
        """Store rows on SSD; returns the rows whose SSD record moved. In the
        ``background``, the write runs in a thread and its moves come with :meth:`drain`."""
        if not len(rows):
            return Relocated()
        if self.ssd is None:
            raise RuntimeError(f"tables {self.names}: rows must leave memory but no SSD tier is configured")
        if not background:
            return self._store(rows)
        self.drain()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctr-ssd-write")
        self._pending = (self._writer.submit(self._store, rows), rows)
        return Relocated()

    def _store(self, rows: Rows) -> Relocated:
        locations, moved = self.ssd.write(rows.tables, rows.ids, rows.values.cpu().numpy(), rows.locations)
        # The device tier may hold a copy of a row the host tier wrote (the tiers are
        # inclusive): that copy's SSD record is the new one now.
        return Relocated.merged([Relocated(rows.tables, rows.ids, locations), moved])

    def wait_for_write(self) -> None:
        """Wait until the SSD write under way is done (any thread; its moves reach the
        memory tiers with the training thread's next :meth:`drain`)."""
        pending = self._pending
        if pending is not None:
            wait([pending[0]])

    def drain(self) -> None:
        """Wait for the SSD write under way; copies in memory learn where rows moved. A
        failed write raises here, and its rows stay readable (:meth:`full_rows`, :meth:`export`)."""
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
            self._unwritten = Rows(rows.tables, rows.ids, rows.values.cpu(), rows.dirty, rows.locations)
            self._failed = e
            raise
        finally:
            self._wait_us += int((time.perf_counter() - start) * 1e6)
        self._pending = None
        self._relocate(moved)

    def _relocate(self, moved: Relocated) -> None:
        """Rows whose SSD copy moved: a copy held in memory keeps its location current."""
        if len(moved.ids):
            for tier in (self.device_tier, self.host_tier):
                if tier is not None:
                    tier.relocate(moved.tables, moved.ids, moved.locations)

    # -- rows held in memory only, for replicas -------------------------------------------

    def absent(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Which of these rows the device tier lacks."""
        return self.device_tier.lookup(tables, ids) < 0

    def hold(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Put rows into the device tier as clean copies (a replica of rows owned elsewhere)."""
        self.device_tier.insert(Rows(tables, ids, rows, np.zeros(len(ids), dtype=bool)))

    def changed(self) -> Rows:
        """The device tier's rows written since they arrived."""
        entries = self.device_tier.entries()
        return entries.select(entries.dirty)

    def forget(self) -> None:
        """Drop every row of the device tier (a replica between intervals)."""
        self.device_tier.clear()

    # -- reads without side effects, writes, checkpoints ------------------------------------

    def full_rows(self, tables: np.ndarray, ids: np.ndarray) -> torch.Tensor:
        """``[weights | optimizer state]`` of rows, freshest tier first; reads only."""
        self.check_ids(tables, ids)
        self.drain()
        out = torch.zeros(len(ids), self.width)
        out[:, : self.dim] = torch.from_numpy(self._initial(tables, ids))
        todo = np.ones(len(ids), dtype=bool)
        for tier in (self.device_tier, self.host_tier):
            if tier is None:
                continue
            slots = tier.lookup(tables, ids)
            hit = todo & (slots >= 0)
            if hit.any():
                out[torch.from_numpy(np.flatnonzero(hit))] = (
                    tier.values[torch.from_numpy(slots[hit]).to(tier.device)].cpu())
                todo &= ~hit
        if self._unwritten is not None and todo.any():
            rest = np.flatnonzero(todo)
            unwritten = self._unwritten
            first, inverse = dedup(np.concatenate([unwritten.tables, tables[rest]]),
                                   np.concatenate([unwritten.ids, ids[rest]]))
            where = first[inverse[len(unwritten):]]  # a row of unwritten, or the query itself
            hit = where < len(unwritten)
            out[torch.from_numpy(rest[hit])] = unwritten.values[torch.from_numpy(where[hit])]
            todo[rest[hit]] = False
        if self.ssd is not None and todo.any():
            rest = np.flatnonzero(todo)
            found, data, _ = self.ssd.read(tables[rest], ids[rest])
            out[torch.from_numpy(rest[found])] = torch.from_numpy(data)
        return out

    def put_rows(self, tables: np.ndarray, ids: np.ndarray, values: torch.Tensor) -> None:
        """Overwrite rows (unique pairs) with ``[weights | optimizer state]`` values."""
        caps = self.device_tier.capacity[self.device_tier.capacity > 0]
        chunk = max(1, int(caps.min()) // 2) if len(caps) else max(1, len(ids))
        for start in range(0, len(ids), chunk):
            t, i = tables[start : start + chunk], ids[start : start + chunk]
            slots = self.device_tier.lookup(t, i)
            miss = slots < 0
            if miss.any():
                slots[miss] = self.fetch(t[miss], i[miss], pinned=slots[~miss])
            index = torch.from_numpy(slots).to(self.device_tier.device)
            self.device_tier.values[index] = values[start : start + chunk].to(self.device_tier.device)
            self.device_tier.dirty[slots] = True
            self.device_tier.changed[slots] = True

    def export(self) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """``(tables, ids, rows)`` of every stored row, its freshest copy, all at once."""
        chunks = list(self.export_chunks())
        if not chunks:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), torch.empty(0, self.width)
        return (np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]),
                torch.cat([c[2] for c in chunks]))

    def export_chunks(self, chunk_rows: int = 1 << 16, changed_only: bool = False,
                      share: SegmentSetWriter | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
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
        self.drain()
        changed_only = changed_only and self.ssd is not None and self._saved_mark is not None
        shadow = KeyIndex()
        # (tier, slots, whether given) in freshest-first order: a row given is skipped in
        # later parts, and so is one held back. Rows are copied a chunk at a time, so the
        # memory tiers' values are never duplicated whole.
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
        for tier, slots, give in parts:
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
        if self._unwritten is not None:
            part = self._unwritten
            fresh = shadow.lookup(part.tables, part.ids) < 0
            shadow.insert(part.tables[fresh], part.ids[fresh], np.zeros(int(fresh.sum()), dtype=np.int64))
            if fresh.any():
                yield part.tables[fresh], part.ids[fresh], part.values[torch.from_numpy(np.flatnonzero(fresh))]
        if self.ssd is not None:
            mark = self._saved_mark if changed_only else None
            if share is not None and isinstance(self.ssd, SsdLog):
                for sealed in self.ssd.sealed(mark):
                    shadowed = shadow.lookup(sealed.keys["table"], sealed.keys["id"]) >= 0 if len(shadow) else False
                    if not share.add(sealed, sealed.live & ~shadowed):  # no link possible: its rows instead
                        yield from self._unshadowed(self.ssd.segment_entries(sealed.number, chunk_rows), shadow)
                records = self.ssd.active_entries(mark, chunk_records=chunk_rows)
            elif changed_only:
                records = self.ssd.entries_since(self._saved_mark, chunk_records=chunk_rows)
            else:
                records = self.ssd.entries(chunk_records=chunk_rows)
            yield from self._unshadowed(records, shadow)

    @staticmethod
    def _unshadowed(records, shadow: KeyIndex) -> Iterator[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
        """SSD records of rows no copy in memory shadows."""
        for tables, ids, data in records:
            keep = shadow.lookup(tables, ids) < 0 if len(shadow) else np.ones(len(ids), dtype=bool)
            if keep.any():
                yield tables[keep], ids[keep], torch.from_numpy(data[keep])

    def mark_saved(self) -> None:
        """The stored rows are in a snapshot now (saved, or just loaded from one): the next
        ``export_chunks(changed_only=True)`` starts from here."""
        self.drain()
        self._saved_mark = self.ssd.mark() if self.ssd is not None else None
        for tier in (self.device_tier, self.host_tier):
            if tier is not None:
                tier.changed[:] = False

    def begin_load(self) -> None:
        """Forget every stored row, before :meth:`load_chunk` calls."""
        try:
            self.drain()
        except OSError:
            pass  # a write that failed before: whatever it held is replaced now
        self._unwritten = self._failed = None
        self._saved_mark = None
        self.device_tier.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.ssd is not None:
            self.ssd.clear()

    def load_chunk(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor, older: bool = False) -> None:
        """Store rows (keys new since :meth:`begin_load`): on SSD when there is one, else in
        memory. With ``older``, rows of keys loaded already are skipped: they came from a
        newer snapshot (loading a chain of incremental ones, newest first)."""
        self.check_ids(tables, ids)
        if older and len(ids):
            self.drain()
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
            self._write_ssd(loaded)  # the memory tiers are empty: no copy to relocate
        elif self.host_tier is not None:
            self.host_tier.insert(loaded)
        else:
            self.device_tier.insert(loaded)

    def adopt_segments(self, segment_set: SegmentSet,
                       keep: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                       older: bool = False) -> list[int]:
        """Take the segments of a snapshot's segment set into the SSD log by hard link (no
        row copied), their records that belong to the set and that ``keep`` (a function
        of ``(tables, ids)`` giving a mask) selects; with ``older``, keys loaded already are
        skipped (see :meth:`load_chunk`). Returns the segments it could not take (another
        record layout or file system): the caller loads their rows instead."""
        if not isinstance(self.ssd, SsdLog) or segment_set.tables != self.names:
            return list(range(len(segment_set.segments)))
        self.drain()
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
            self.check_ids(tables[take], ids[take])
            folder = segment_set.path.parent
            if not self.ssd.adopt(folder / segment.file, folder / segment.keys, segment.records, segment.crc32, keys,
                                  take):
                left.append(n)
                refused = True  # no hard link from this snapshot to this SSD directory
        return left

    def _present(self, tables: np.ndarray, ids: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
        """Which keys the SSD tier holds already, exactly: keys with a candidate in the
        index (none: absent) are checked against their records (the index's hash may name
        another key), a chunk at a time."""
        present = np.zeros(len(ids), dtype=bool)
        if isinstance(self.ssd, SsdLog):
            candidates = np.flatnonzero(self.ssd.index.lookup(tables, ids)[0] >= 0)
        else:
            candidates = np.arange(len(ids))
        for start in range(0, len(candidates), chunk):
            part = candidates[start : start + chunk]
            present[part] = self.ssd.read(tables[part], ids[part])[0]
        return present

    def load(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Replace every stored row by ``rows`` of (``tables``, ``ids``)."""
        self.begin_load()
        self.load_chunk(tables, ids, rows)
