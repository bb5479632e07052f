"""Where the rows of a table group live (device tier, host tier, SSD) and how they move."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.table_setup import TableSetup, has_host_tier
from ctr_lightning.embedding.tiers.group_tables import GroupTables
from ctr_lightning.embedding.tiers.miss_path import Admit, Live, MissPath
from ctr_lightning.embedding.tiers.interval_rows import IntervalRows
from ctr_lightning.embedding.tiers.row_cache import RowCache
from ctr_lightning.embedding.tiers.row_export import RowExport
from ctr_lightning.embedding.tiers.row_load import RowLoad
from ctr_lightning.embedding.tiers.ssd.direct_store import DirectSsdStore
from ctr_lightning.embedding.tiers.ssd.ssd_log import SsdLog
from ctr_lightning.embedding.tiers.ssd.ssd_tier import NO_SSD_COUNTERS, SsdTier
from ctr_lightning.embedding.tiers.ssd_writer import SsdWriter

if TYPE_CHECKING:
    from ctr_lightning.embedding.snapshots.segment_sets import SegmentSet, SegmentSetWriter
    from ctr_lightning.embedding.prefetch.working_set import WorkingSet

_RESERVE_BYTES = 4 << 30


class TierStack:
    """The tiers of a few tables that share a row layout: ``[weights | optimizer state]``.

    The device tier is the one the compute reads; misses come from the host tier, then
    the SSD tier (or rows read ahead from it), then the counter-based initializer
    (:class:`MissPath`). Evicted dirty rows go one tier down; clean ones are dropped,
    since the tier below (or the initializer) already has them. Rows leave DRAM for SSD
    in :class:`SsdWriter`, in a thread. The stack builds the tiers and hands its other
    jobs to one collaborator each: :class:`RowExport` (every row, for snapshots),
    :class:`RowLoad` (every row replaced), :class:`IntervalRows` (a k-step interval's local copy).

    Example::

        tiers = TierStack("dim64", tables, setup)
        slots = tiers.fetch(tables_of_misses, ids_of_misses, pinned=slots_of_hits)
        tiers.full_rows(tables, ids)     # freshest copy of each row, read only
    """

    def __init__(self, name: str, tables: list[EmbeddingBagConfig], setup: TableSetup) -> None:
        self.tables = GroupTables(tables, setup)
        storage = [setup.storage[t.name] for t in tables]
        lfu = [s.eviction == "lfu" for s in storage]
        device_caps, host_caps = setup.capacities(tables)
        # Unbounded tiers reserve address space for every row the configs expect (never more
        # than _RESERVE_BYTES); untouched pages of the reservation cost no memory.
        reserve = int(min(self.tables.num_embeddings.sum(), _RESERVE_BYTES // (self.width * 4)))
        self.device_tier = RowCache(self.width, device_caps, lfu, setup.device, reserve_rows=reserve)
        self.host_tier = (RowCache(self.width, host_caps, lfu, "cpu", reserve_rows=reserve)
                          if has_host_tier(device_caps, host_caps) else None)
        ssd_dir = storage[0].ssd_dir
        self.ssd: SsdTier | None = None
        if ssd_dir is not None and self.bounded.all():
            self.ssd = DirectSsdStore(ssd_dir, name, self.width, self.names, list(self.tables.num_embeddings))
        elif ssd_dir is not None:
            # Where rows expire, the log deletes the records of rows gone by their stamp.
            stamps = setup.core_width(self.tables.dim) if any(n in setup.expiry for n in self.names) else None
            self.ssd = SsdLog(ssd_dir, name, self.width, self.names, segment_bytes=storage[0].ssd_segment_bytes,
                              stamp_column=stamps)
        memory = [tier for tier in (self.device_tier, self.host_tier) if tier is not None]
        self.writer = SsdWriter(self.ssd, self.names, memory)
        self.misses = MissPath(self.tables, self.device_tier, self.host_tier, self.ssd, self.writer)
        self.interval_rows = IntervalRows(self.device_tier)
        self._export = RowExport(self.device_tier, self.host_tier, self.ssd, self.writer, self.width)
        self._load = RowLoad(self.tables, self.device_tier, self.host_tier, self.ssd, self.writer)
        # Which stored rows are still there (see RowExpiry); None: all. Rows it says are gone
        # read as rows stored nowhere, wherever a copy of them lies.
        self.live: Live | None = None

    @property
    def names(self) -> list[str]:
        return self.tables.names

    @property
    def width(self) -> int:
        return self.tables.width

    @property
    def seed(self) -> int:
        return self.tables.seed

    @property
    def bounded(self) -> np.ndarray:
        """Per table, whether its ids are bounded (``0 <= id < num_embeddings``)."""
        return self.tables.bounded

    def count_device_hits(self, hits: int) -> None:
        self.misses.counters["device_hits"] += hits

    def counters(self) -> dict[str, int]:
        """Cumulative: rows found in each tier, rows new, microseconds waited on SSD reads,
        spent making room in the device tier (choosing victims, handing them down) and
        waiting for the SSD writes under way, and the SSD tier's own
        :meth:`SsdTier.counters` (its writes run in a thread)."""
        ssd = self.ssd.counters() if self.ssd is not None else NO_SSD_COUNTERS
        return {**self.misses.counters, "evict_us": self.misses.evict_us, "ssd_wait_us": self.writer.wait_us, **ssd}

    def storage(self) -> dict[str, int]:
        """What the tiers hold now: rows and bytes on SSD (on disk and live), the SSD index's
        bytes, and the bytes of the memory tiers (device tier counted when in host memory)."""
        self.drain()
        held = {"ssd_rows": 0, "ssd_bytes": 0, "ssd_live_bytes": 0, "ssd_index_bytes": 0,
                 "memory_rows": len(self.device_tier) + (len(self.host_tier) if self.host_tier is not None else 0),
                 "dram_bytes": self.host_tier.nbytes if self.host_tier is not None else 0}
        if self.device_tier.device.type == "cpu":
            held["dram_bytes"] += self.device_tier.nbytes
        if self.ssd is not None:
            held.update(ssd_rows=len(self.ssd), ssd_bytes=self.ssd.disk_bytes, ssd_live_bytes=self.ssd.live_bytes,
                         ssd_index_bytes=self.ssd.index_bytes)
            held["dram_bytes"] += self.ssd.index_bytes
        return held

    def rank_by(self, rank: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        """What the expiry floors apply to in the SSD log's records (RowExpiry.rank_keys)."""
        if isinstance(self.ssd, SsdLog):
            self.ssd.rank = rank

    def expire_below(self, floors: np.ndarray) -> None:
        """Rows last looked up before ``floors[t]`` are gone (see RowExpiry): the SSD log's
        cleaning deletes their records from now on, in its thread."""
        if isinstance(self.ssd, SsdLog):
            self.ssd.floors = floors.copy()  # one reference swap: a write under way reads either

    def check_ids(self, tables: np.ndarray, ids: np.ndarray) -> None:
        """An error naming the table and id of the first id its table cannot hold."""
        self.tables.check_ids(tables, ids)

    def move_device_tier(self, device: torch.device) -> None:
        self.device_tier.to(device)

    # -- misses (MissPath), SSD writes (SsdWriter) -------------------------------------------

    def pin(self, slots: np.ndarray, holder: object) -> Callable[[], None]:
        """Keep these device rows in place until a training forward's backward (see
        :meth:`ForwardPins.pin`); returns the release."""
        return self.misses.pins.pin(slots, holder)

    def fetch(self, tables: np.ndarray, ids: np.ndarray, pinned: np.ndarray,
              working_set: WorkingSet | None = None, admit: Admit | None = None) -> np.ndarray:
        """Bring rows absent from the device tier into it; returns their slots (see
        :meth:`MissPath.fetch`; -1: a row stored nowhere that ``admit`` turned away)."""
        return self.misses.fetch(tables, ids, pinned, working_set, admit, self.live)

    def wait_for_write(self) -> None:
        """Wait until the SSD write under way is done (any thread)."""
        self.writer.wait_for_write()

    def drain(self) -> None:
        """Wait for the SSD write under way; copies in memory learn where rows moved. A
        failed write raises here, and its rows stay readable (:meth:`full_rows`, :meth:`export`)."""
        self.writer.drain()

    # -- reads without side effects, writes --------------------------------------------------

    def stored(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Which of these rows are stored in some tier, and not gone (reads only)."""
        if self.live is not None:
            return self._read(tables, ids)[1]
        self.drain()
        held = np.zeros(len(ids), dtype=bool)
        for tier in (self.device_tier, self.host_tier):
            if tier is not None:
                held |= tier.lookup(tables, ids) >= 0
        if self.writer.unwritten is not None and not held.all():
            rest = np.flatnonzero(~held)
            held[rest] = self.writer.unwritten_rows(tables[rest], ids[rest])[0]
        if self.ssd is not None and not held.all():
            rest = np.flatnonzero(~held)
            maybe = rest[self.ssd.may_hold(tables[rest], ids[rest])]
            held[maybe] = self.ssd.read(tables[maybe], ids[maybe])[0]
        return held

    def full_rows(self, tables: np.ndarray, ids: np.ndarray) -> torch.Tensor:
        """``[weights | optimizer state]`` of rows, freshest tier first; reads only."""
        self.check_ids(tables, ids)
        return self._read(tables, ids)[0]

    def _read(self, tables: np.ndarray, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """``(rows, stored)``: the freshest copy of each row (rows stored nowhere, or gone:
        what they read), and which are stored and live."""
        self.drain()
        out = torch.zeros(len(ids), self.width)
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
        if self.writer.unwritten is not None and todo.any():
            rest = np.flatnonzero(todo)
            hit, rows = self.writer.unwritten_rows(tables[rest], ids[rest])
            out[torch.from_numpy(rest[hit])] = rows
            todo[rest[hit]] = False
        if self.ssd is not None and todo.any():
            rest = np.flatnonzero(todo)
            found, data, _ = self.ssd.read(tables[rest], ids[rest])
            out[torch.from_numpy(rest[found])] = torch.from_numpy(data)
            todo[rest[found]] = False
        stored = ~todo
        if self.live is not None and stored.any():
            held = np.flatnonzero(stored)
            stored[held[~self.live(tables[held], out[torch.from_numpy(held)])]] = False
        if not stored.all():
            unstored = np.flatnonzero(~stored)
            out[torch.from_numpy(unstored)] = 0.0
            out[torch.from_numpy(unstored), : self.tables.dim] = torch.from_numpy(
                self.tables.unstored(tables[unstored], ids[unstored]))
        return out, stored

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

    # -- every row: export (RowExport), load (RowLoad) ------------------------------------------

    def export(self) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """``(tables, ids, rows)`` of every stored row that is live, its freshest copy, all at once."""
        tables, ids, rows = self._export.all()
        if self.live is None or not len(ids):
            return tables, ids, rows
        keep = self.live(tables, rows)
        return tables[keep], ids[keep], rows[torch.from_numpy(keep)]

    def export_chunks(self, chunk_rows: int = 1 << 16, changed_only: bool = False,
                      share: SegmentSetWriter | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
        """Every stored row once (live, where rows expire), its freshest copy, a chunk at a time; with ``changed_only``,
        those changed since :meth:`mark_saved`; ``share`` takes sealed SSD segments by hard
        link instead (see :meth:`RowExport.chunks`)."""
        chunks = self._export.chunks(chunk_rows, changed_only, share)
        if self.live is None:
            return chunks
        # Rows gone are left out; a snapshot's hard-linked segments may still hold them (their
        # stamps say they are gone, as here).
        return ((t[keep], i[keep], r[torch.from_numpy(keep)])
                for t, i, r in chunks for keep in [self.live(t, r)] if keep.any())

    def mark_saved(self) -> None:
        """The stored rows are in a snapshot now (saved, or just loaded from one): the next
        ``export_chunks(changed_only=True)`` starts from here."""
        self._export.mark_saved()

    def begin_load(self) -> None:
        """Forget every stored row, before :meth:`load_chunk` calls."""
        self._load.begin()
        self._export.forget_mark()

    def load_chunk(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor, older: bool = False) -> None:
        """Store rows (keys new since :meth:`begin_load`); with ``older``, keys loaded
        already are skipped (see :meth:`RowLoad.chunk`)."""
        self._load.chunk(tables, ids, rows, older)

    def adopt_segments(self, segment_set: SegmentSet,
                       keep: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                       older: bool = False) -> list[int]:
        """Take a snapshot's SSD segments by hard link; returns those it could not take,
        whose rows the caller loads instead (see :meth:`RowLoad.adopt`)."""
        return self._load.adopt(segment_set, keep, older)

    def load(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Replace every stored row by ``rows`` of (``tables``, ``ids``)."""
        self.begin_load()
        self.load_chunk(tables, ids, rows)
