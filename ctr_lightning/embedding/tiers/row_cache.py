"""A memory tier (device or host) that caches rows of many tables in one tensor."""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from ctr_lightning.embedding.tiers.key_index import KeyIndex


@numba.njit(cache=True, nogil=True)
def _touch(last_used, uses, slots, clock):
    for s in slots:
        last_used[s] = clock
        uses[s] += 1


@numba.njit(cache=True, nogil=True)
def _claim(slots, tables, ids, clock, table_code, slot_id, dirty, uses, needed_until, last_used, ssd_location):
    """The bookkeeping of rows entering ``slots``, in one pass."""
    for i in range(len(slots)):
        s = slots[i]
        table_code[s] = tables[i] + 1
        slot_id[s] = ids[i]
        dirty[s] = False
        uses[s] = 0
        needed_until[s] = -1
        last_used[s] = clock
        ssd_location[s] = -1


@numba.njit(cache=True, nogil=True)
def _victim_candidates(table_code, count, pinned, need, lfu, last_used, uses):
    """The slots of ``[0, count)`` that may be evicted (held, not pinned, of a table with
    ``need > 0``), grouped by table (``starts[t]:starts[t + 1]``), each with its eviction key:
    the smallest go first. Two passes over the slots, where separate array operations took
    about ten (most of the time of a choice, which scans every slot)."""
    num_tables = len(need)
    blocked = np.zeros(count, dtype=np.bool_)
    for s in pinned:
        if s < count:
            blocked[s] = True
    starts = np.zeros(num_tables + 1, dtype=np.int64)
    for s in range(count):
        t = table_code[s] - 1
        if t >= 0 and need[t] > 0 and not blocked[s]:
            starts[t + 1] += 1
    for t in range(num_tables):
        starts[t + 1] += starts[t]
    slots = np.empty(starts[num_tables], dtype=np.int64)
    keys = np.empty(starts[num_tables], dtype=np.int64)
    fill = starts[:num_tables].copy()
    for s in range(count):
        t = table_code[s] - 1
        if t >= 0 and need[t] > 0 and not blocked[s]:
            i = fill[t]
            slots[i] = s
            # Least recently used first; under LFU, least used, then least recent.
            keys[i] = (uses[s] << 32) | (last_used[s] & 0xFFFFFFFF) if lfu[t] else last_used[s]
            fill[t] += 1
    return slots, keys, starts


class TierFull(RuntimeError):
    """The rows a tier must hold at once (pinned, plus those arriving) exceed a table's
    capacity there: ``touched`` rows of table number ``table``, ``capacity`` rows."""

    def __init__(self, message: str, table: int, touched: int, capacity: int) -> None:
        super().__init__(message)
        self.table, self.touched, self.capacity = table, touched, capacity


@dataclass
class Rows:
    """Rows leaving or entering a tier: which (table, id), their values, whether dirty, the
    SSD record each was last stored at (-1: none; see :class:`SsdLog`), and whether it
    changed since the last table snapshot (see :meth:`TierStack.mark_saved`)."""

    tables: np.ndarray  # int64 table index per row
    ids: np.ndarray  # int64 feature id per row
    values: torch.Tensor  # [n, width]
    dirty: np.ndarray  # bool per row
    locations: np.ndarray | None = None  # int64 per row; None: -1 for all
    changed: np.ndarray | None = None  # bool per row; None: False for all

    def __post_init__(self) -> None:
        if self.locations is None:
            self.locations = np.full(len(self.ids), -1, dtype=np.int64)
        if self.changed is None:
            self.changed = np.zeros(len(self.ids), dtype=bool)

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, mask: np.ndarray) -> Rows:
        if mask.all():  # the common case of evictions in training: every victim is dirty
            return self
        index = torch.from_numpy(np.flatnonzero(mask)).to(self.values.device)
        return Rows(self.tables[mask], self.ids[mask], self.values.index_select(0, index), self.dirty[mask],
                    self.locations[mask], self.changed[mask])


class RowCache:
    """Rows of several tables in one ``[slots, width]`` tensor, with per-table capacities.

    Slots are shared; each table's capacity is enforced by counting. When a table is
    full, its least recently (LRU) or least frequently (LFU) used rows are evicted,
    never those pinned for the batch in flight. Evicted rows are handed back to the
    caller, which writes the dirty ones to the tier below.

    Example::

        cache = RowCache(width=8, capacities=[100, None], lfu=[False, False], device="cpu")
        need = cache.room_needed(tables)
        victim_slots, victims = cache.choose_victims(need, pinned=np.array([], dtype=np.int64), names=["a", "b"])
        cache.release(victim_slots)   # after writing the dirty victims below
        slots = cache.insert(Rows(tables, ids, values, dirty))
    """

    def __init__(
        self,
        width: int,
        capacities: list[int | None],
        lfu: list[bool],
        device: torch.device | str,
        reserve_rows: int = 1024,
    ) -> None:
        self.width = width
        self.device = torch.device(device)
        self.capacity = np.array([-1 if c is None else c for c in capacities], dtype=np.int64)
        self.lfu = np.array(lfu, dtype=bool)
        # A fully bounded tier reserves its whole budget; others start from the hint and grow.
        bounded = (self.capacity >= 0).all()
        # The index too: growing it means touching every page of a table twice the size,
        # seconds for millions of rows, in the middle of the step that fills the tier.
        self.index = KeyIndex(int(self.capacity.sum()) if bounded else 1024, parallel=True)  # training thread only
        self.occupancy = np.zeros(len(capacities), dtype=np.int64)
        self.clock = 0
        self.unbounded = bool((self.capacity < 0).all())
        self._allocate(int(self.capacity.sum()) if bounded else max(reserve_rows, 16))

    def _allocate(self, slots: int) -> None:
        # Uninitialised and calloc'ed arrays: pages cost memory only once a row is used.
        self.values = torch.empty(slots, self.width, device=self.device)
        self.table_code = np.zeros(slots, dtype=np.int32)  # table + 1; 0 marks a free slot
        self.slot_id = np.empty(slots, dtype=np.int64)
        self.dirty = np.zeros(slots, dtype=bool)
        # Written since the last table snapshot: a clean copy of a row changed since, or a
        # dirty row unchanged since, is not part of an incremental snapshot.
        self.changed = np.zeros(slots, dtype=bool)
        self.last_used = np.zeros(slots, dtype=np.int64)
        self.uses = np.zeros(slots, dtype=np.int64)
        self.needed_until = np.full(slots, -1, dtype=np.int64)  # last upcoming batch that needs the row
        self.slot_mark = np.full(slots, -1, dtype=np.int32)  # scratch of KeyIndex.lookup_unique
        self.ssd_location = np.full(slots, -1, dtype=np.int64)  # the SSD record the row was read from
        self.never_used = 0  # slots [never_used, len) were never handed out
        self.free = np.empty(0, dtype=np.int64)  # released slots, reused first
        self.index.clear()
        self.occupancy[:] = 0

    @property
    def slot_table(self) -> np.ndarray:
        """Table of each slot handed out so far, -1 where free."""
        return self.table_code[: self.never_used].astype(np.int64) - 1

    def __len__(self) -> int:
        return int(self.occupancy.sum())

    @property
    def nbytes(self) -> int:
        """Bytes this tier holds: its rows' values and its bookkeeping (index included)."""
        arrays = (self.table_code, self.slot_id, self.dirty, self.last_used, self.uses, self.needed_until,
                  self.slot_mark, self.ssd_location, self.free)
        return self.values.numel() * self.values.element_size() + sum(a.nbytes for a in arrays) + self.index.nbytes

    def lookup(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return self.index.lookup(tables, ids)

    def lookup_unique(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first, inverse, slots)``: the unique (table, id) pairs in order of first
        appearance (as :func:`dedup`) and the slot of each, -1 where absent."""
        return self.index.lookup_unique(tables, ids, self.slot_mark)

    def touch(self, slots: np.ndarray) -> None:
        if self.unbounded:
            return  # nothing is ever evicted: recency and use counts are never read
        self.clock += 1
        _touch(self.last_used, self.uses, slots, self.clock)

    def room_needed(self, tables: np.ndarray) -> np.ndarray:
        """Per table, how many rows must go before ``tables`` (one entry per new row) fit."""
        incoming = np.bincount(tables, minlength=len(self.capacity))
        over = self.occupancy + incoming - self.capacity
        return np.where(self.capacity >= 0, np.maximum(over, 0), 0)

    def choose_victims(self, need: np.ndarray, pinned: np.ndarray, names: list[str],
                       needed_after: int | None = None) -> tuple[np.ndarray, Rows]:
        """``need[t]`` unpinned rows of each table t to evict: ``(slots, rows)``.

        With ``needed_after``, rows an upcoming batch needs (``needed_until >=
        needed_after``, set by a prefetcher) are spared too, as long as enough others remain.
        The caller writes the dirty ones below, then calls :meth:`release`, so a failed
        write leaves them here.
        """
        if needed_after is not None:
            upcoming = np.flatnonzero(self.needed_until[: self.never_used] >= needed_after)
            if len(upcoming):
                try:
                    return self.choose_victims(need, np.concatenate([pinned, upcoming]), names)
                except TierFull:
                    pass  # the lookahead wants more than fits: keep only this batch's pins
        if not need.any():
            empty = np.empty(0, dtype=np.int64)
            return empty, self.rows_at(empty)
        # Free a little more than asked, so the selection below runs every few batches, not every one.
        wanted = np.where(need > 0, need + self.capacity // 32, 0)
        slots, keys, starts = _victim_candidates(self.table_code, self.never_used, pinned, need, self.lfu,
                                                 self.last_used, self.uses)
        available = np.diff(starts)
        short = np.flatnonzero(available < need)
        if len(short):
            t = int(short[0])
            # Rows pinned (held for this batch or a backward to come) plus the rows arriving.
            touched = int(need[t] + self.capacity[t] - available[t])
            raise TierFull(
                f"table {names[t]!r}: one batch touches more rows than its tier holds ({touched} rows "
                f"in the batches in flight, capacity {int(self.capacity[t])} rows); raise the capacity "
                f"or lower the batch size",
                t, touched, int(self.capacity[t]))
        take = np.minimum(wanted, available)
        victims = []
        for t in np.flatnonzero(take):  # the take[t] smallest keys of table t, in O(rows of t)
            a, b = starts[t], starts[t + 1]
            chosen = slots[a:b]
            if take[t] < b - a:
                chosen = chosen[np.argpartition(keys[a:b], take[t] - 1)[: take[t]]]
            victims.append(chosen)
        victims = np.sort(np.concatenate(victims)) if victims else np.empty(0, dtype=np.int64)
        return victims, self.rows_at(victims)

    def release(self, slots: np.ndarray) -> None:
        tables = self.table_code[slots].astype(np.int64) - 1
        self.index.remove(tables, self.slot_id[slots])
        self.occupancy -= np.bincount(tables, minlength=len(self.occupancy))
        self.table_code[slots] = 0
        self.dirty[slots] = False
        self.free = np.concatenate([self.free, slots])

    def _take_slots(self, n: int) -> np.ndarray:
        reused = self.free[len(self.free) - min(n, len(self.free)) :][::-1].copy()
        self.free = self.free[: len(self.free) - len(reused)]
        rest = n - len(reused)
        if self.never_used + rest > len(self.table_code):
            self._grow(self.never_used + rest)
        fresh = np.arange(self.never_used, self.never_used + rest, dtype=np.int64)
        self.never_used += rest
        return np.concatenate([reused, fresh])

    def insert(self, rows: Rows) -> np.ndarray:
        """Place rows (room made with :meth:`choose_victims` and :meth:`release`); overwrite those present."""
        slots = self.place(rows.tables, rows.ids, rows.dirty, changed=rows.changed)
        self.values[torch.from_numpy(slots).to(self.device)] = rows.values.to(self.device)
        self.ssd_location[slots] = rows.locations
        return slots

    def relocate(self, tables: np.ndarray, ids: np.ndarray, locations: np.ndarray) -> None:
        """Rows held here whose SSD copy moved to ``locations`` (an SSD log cleaning)."""
        slots = self.lookup(tables, ids)
        held = slots >= 0
        self.ssd_location[slots[held]] = locations[held]

    def place(self, tables: np.ndarray, ids: np.ndarray, dirty: np.ndarray, absent: bool = False,
              changed: np.ndarray | None = None) -> np.ndarray:
        """Slots for these (table, id) pairs, taking free ones for those not here yet, with
        the bookkeeping of :meth:`insert` but no values: the caller writes the rows.
        ``absent``: the caller knows none of them is here (skips a lookup)."""
        if absent:
            slots = self._take_slots(len(ids))
            fresh_tables, fresh_ids, fresh = tables, ids, slots
        else:
            slots = self.lookup(tables, ids)
            new = slots < 0
            fresh = self._take_slots(int(new.sum()))
            slots[new] = fresh
            fresh_tables, fresh_ids = tables[new], ids[new]
        self.index.insert(fresh_tables, fresh_ids, fresh)
        _claim(fresh, fresh_tables, fresh_ids, self.clock, self.table_code, self.slot_id, self.dirty, self.uses,
               self.needed_until, self.last_used, self.ssd_location)
        self.occupancy += np.bincount(fresh_tables, minlength=len(self.occupancy))
        self.dirty[slots] |= dirty
        self.changed[fresh] = False
        if changed is not None:
            self.changed[slots] |= changed
        return slots

    def _grow(self, needed: int) -> None:
        old = len(self.table_code)
        size = max(needed, 2 * old)
        values = torch.empty(size, self.width, device=self.device)
        values[:old] = self.values
        self.values = values
        pad = size - old
        self.table_code = np.concatenate([self.table_code, np.zeros(pad, dtype=np.int32)])
        self.slot_id = np.concatenate([self.slot_id, np.empty(pad, dtype=np.int64)])
        self.dirty = np.concatenate([self.dirty, np.zeros(pad, dtype=bool)])
        self.changed = np.concatenate([self.changed, np.zeros(pad, dtype=bool)])
        self.last_used = np.concatenate([self.last_used, np.zeros(pad, dtype=np.int64)])
        self.uses = np.concatenate([self.uses, np.zeros(pad, dtype=np.int64)])
        self.needed_until = np.concatenate([self.needed_until, np.full(pad, -1, dtype=np.int64)])
        self.slot_mark = np.concatenate([self.slot_mark, np.full(pad, -1, dtype=np.int32)])
        self.ssd_location = np.concatenate([self.ssd_location, np.full(pad, -1, dtype=np.int64)])

    def rows_at(self, slots: np.ndarray) -> Rows:
        """The rows at ``slots``, values copied (victims, or a chunk of a checkpoint)."""
        index = torch.from_numpy(slots).to(self.device)
        return Rows(self.table_code[slots].astype(np.int64) - 1, self.slot_id[slots].copy(),
                    self.values.index_select(0, index), self.dirty[slots].copy(), self.ssd_location[slots].copy(),
                    self.changed[slots].copy())

    def entries(self) -> Rows:
        """Every row held, with its values (a copy of the tier)."""
        return self.rows_at(self.held_slots())

    def held_slots(self) -> np.ndarray:
        """The slots that hold a row."""
        return np.flatnonzero(self.slot_table >= 0)

    def keys_at(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(tables, ids)`` of the rows at ``slots``, without their values."""
        return self.table_code[slots].astype(np.int64) - 1, self.slot_id[slots].copy()

    def clear(self) -> None:
        self._allocate(len(self.table_code))

    def to(self, device: torch.device | str) -> RowCache:
        """Move the rows to ``device``; the bookkeeping stays in host memory."""
        device = torch.device(device)
        if device != self.device:
            self.values = self.values.to(device)
            self.device = device
        return self
