"""How rows missing from the device tier get there, and what is evicted to make room."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ctr_lightning.embedding.tiers.forward_pins import ForwardPins
from ctr_lightning.embedding.tiers.group_tables import GroupTables
from ctr_lightning.embedding.tiers.row_cache import RowCache, Rows, TierFull
from ctr_lightning.embedding.tiers.ssd.ssd_tier import SsdTier
from ctr_lightning.embedding.tiers.ssd_writer import SsdWriter

if TYPE_CHECKING:
    from ctr_lightning.embedding.prefetch.working_set import WorkingSet

# admit(positions, tables, ids): which rows stored nowhere (at these positions of a fetch)
# get a row now; the others get slot -1 (they read zeros and are not updated).
Admit = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
# live(tables, rows): which of these stored rows ([n, width]) are still there (not expired).
Live = Callable[[np.ndarray, torch.Tensor], np.ndarray]


class MissPath:
    """Fetches a batch's misses into the device tier: each row from the host tier, else
    from the rows read ahead (a :class:`WorkingSet`), else from SSD, else from the
    initializer (a row stored nowhere yet). Room is made by evicting device rows: dirty
    ones go one tier down (the host tier; from there, or straight from the device tier
    where there is no host tier, the :class:`SsdWriter` takes them out of DRAM to SSD),
    clean ones are dropped, since the tier below (or the initializer) already has them.

    Example::

        misses = MissPath(tables, device_tier, host_tier, ssd, writer)
        slots = misses.fetch(tables_of_misses, ids_of_misses, pinned=slots_of_hits)
    """

    def __init__(self, tables: GroupTables, device_tier: RowCache, host_tier: RowCache | None,
                 ssd: SsdTier | None, writer: SsdWriter) -> None:
        self.tables = tables
        self.device_tier, self.host_tier, self.ssd = device_tier, host_tier, ssd
        self.writer = writer
        self.pins = ForwardPins()
        self.counters = {"device_hits": 0, "host_hits": 0, "ssd_hits": 0, "new_rows": 0, "ssd_stall_us": 0}
        self.evict_us = 0  # microseconds spent making room in the device tier

    def fetch(self, tables: np.ndarray, ids: np.ndarray, pinned: np.ndarray,
              working_set: WorkingSet | None = None, admit: Admit | None = None,
              live: Live | None = None) -> np.ndarray:
        """Bring rows absent from the device tier into it; returns their slots. Rows stored
        nowhere, and rows found whose copy ``live`` says is gone (expired), start from the
        initializer where ``admit`` (None: all) takes them, and get slot -1 where it does not.

        Room is made by evicting rows that are neither ``pinned`` nor pinned by a training
        forward (:class:`ForwardPins`), and, with an active ``working_set``, rows an upcoming
        batch needs only as a last resort; rows read ahead are taken from it.
        """
        # Moves of the SSD write under way reach the memory tiers before anything is read;
        # the write started below reports its own at the next drain.
        self.writer.drain()
        self.writer.check_usable()
        reading_ahead = working_set is not None and working_set.current_batch is not None
        rows, locations, filled = self._gather(tables, ids, working_set if reading_ahead else None)
        fresh = ~filled  # rows that start from the initializer
        if live is not None and filled.any():
            found = np.flatnonzero(filled)
            fresh[found[~live(tables[found], rows[torch.from_numpy(found)])]] = True
        placed = np.ones(len(ids), dtype=bool)  # rows that get a slot: all but those admission turns away
        if admit is not None and fresh.any():
            new = np.flatnonzero(fresh)
            placed[new[~admit(new, tables[new], ids[new])]] = False
        start = time.perf_counter()
        need = self.device_tier.room_needed(tables[placed])
        victim_slots, victims = self._choose_victims(need, pinned, working_set.current_batch if reading_ahead else None)
        self._demote(victims.select(victims.dirty))
        self.device_tier.release(victim_slots)
        self.evict_us += int((time.perf_counter() - start) * 1e6)
        clean = np.zeros(len(ids), dtype=bool)
        if not fresh.any():
            slots = self.device_tier.insert(Rows(tables, ids, rows, clean, locations))
        else:
            slots = np.full(len(ids), -1, dtype=np.int64)
            old, new = np.flatnonzero(~fresh), np.flatnonzero(fresh & placed)
            if len(old):
                slots[old] = self.device_tier.insert(Rows(tables[old], ids[old], rows[torch.from_numpy(old)], clean[old],
                                                          locations[old]))
            if len(new):  # rows start from the initializer, written in place
                slots[new] = self.device_tier.place(tables[new], ids[new], clean[new], absent=True)
                self.tables.initialize(self.device_tier.values, slots[new], tables[new], ids[new])
                # An expired row's SSD record is the one its next write replaces.
                self.device_tier.ssd_location[slots[new]] = locations[new]
                self.counters["new_rows"] += len(new)
        if reading_ahead:
            stored = slots >= 0
            working_set.arrived(self.device_tier, tables[stored], ids[stored], slots[stored])
        return slots

    def _gather(self, tables: np.ndarray, ids: np.ndarray,
                working_set: WorkingSet | None) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """``(rows, locations, filled)``: the rows found below the device tier, where their
        SSD copy lies (-1: none), and which were found at all."""
        rows = torch.empty(len(ids), self.tables.width)
        locations = np.full(len(ids), -1, dtype=np.int64)
        filled = np.zeros(len(ids), dtype=bool)
        if self.host_tier is not None:
            hslots = self.host_tier.lookup(tables, ids)
            hit = hslots >= 0
            if hit.any():
                rows[torch.from_numpy(np.flatnonzero(hit))] = self.host_tier.values[torch.from_numpy(hslots[hit])]
                locations[hit] = self.host_tier.ssd_location[hslots[hit]]
                filled |= hit
                self.counters["host_hits"] += int(hit.sum())
        if self.ssd is not None and not filled.all():
            rest = np.flatnonzero(~filled)
            if working_set is not None:
                found, data, where = working_set.take(tables[rest], ids[rest], self.ssd)
                if found.any():
                    rows[torch.from_numpy(rest[found])] = data
                    locations[rest[found]] = where
                    filled[rest[found]] = True
                    rest = rest[~found]
            start = time.perf_counter()
            found, data, where = self.ssd.read(tables[rest], ids[rest])
            self.counters["ssd_stall_us"] += int((time.perf_counter() - start) * 1e6)
            if found.any():
                rows[torch.from_numpy(rest[found])] = torch.from_numpy(data)
                locations[rest[found]] = where
                filled[rest[found]] = True
                self.counters["ssd_hits"] += int(found.sum())
        return rows, locations, filled

    def _choose_victims(self, need: np.ndarray, pinned: np.ndarray,
                        needed_after: int | None) -> tuple[np.ndarray, Rows]:
        """Device rows to evict, sparing ``pinned`` (this batch's) and the rows of training
        forwards whose backward is to come."""
        for collected in (False, True):
            if collected:
                # Graphs kept alive only by reference cycles (a traceback, torchrec's all-to-all
                # requests) are freed by the cycle collector alone; their release comes with it.
                gc.collect()
            held = self.pins.held()
            try:
                return self.device_tier.choose_victims(need, np.concatenate([pinned, *held]), self.tables.names,
                                                       needed_after)
            except TierFull as full:
                if not held:
                    raise  # this batch alone is too big: the message says so
                if collected:
                    raise ForwardPins.blame(full, held, self.device_tier.table_code, self.tables.names) from None
        raise AssertionError("unreachable")

    def _demote(self, rows: Rows) -> None:
        """Hand dirty rows leaving the device tier down: into the host tier, whose own
        dirty victims leave DRAM for SSD; without a host tier, straight to SSD."""
        if not len(rows):
            return
        if self.host_tier is None:
            self.writer.write_behind(rows)
            return
        need = self.host_tier.room_needed(rows.tables)
        victim_slots, victims = self.host_tier.choose_victims(need, np.empty(0, dtype=np.int64), self.tables.names)
        self.writer.write_behind(victims.select(victims.dirty))
        self.host_tier.release(victim_slots)
        self.host_tier.insert(Rows(rows.tables, rows.ids, rows.values.cpu(), np.ones(len(rows), dtype=bool),
                                   rows.locations, rows.changed))
