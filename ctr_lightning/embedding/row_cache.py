"""A memory tier (device or host) that caches rows of many tables in one tensor."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ctr_lightning.embedding.key_index import KeyIndex


@dataclass
class Rows:
    """Rows leaving or entering a tier: which (table, id), their values, and whether dirty."""

    tables: np.ndarray  # int64 table index per row
    ids: np.ndarray  # int64 feature id per row
    values: torch.Tensor  # [n, width]
    dirty: np.ndarray  # bool per row

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, mask: np.ndarray) -> Rows:
        index = torch.from_numpy(np.flatnonzero(mask)).to(self.values.device)
        return Rows(self.tables[mask], self.ids[mask], self.values.index_select(0, index), self.dirty[mask])


class RowCache:
    """Rows of several tables in one ``[slots, width]`` tensor, with per-table capacities.

    Slots are shared; each table's capacity is enforced by counting. When a table is
    full, its least recently (LRU) or least frequently (LFU) used rows are evicted,
    never those pinned for the batch in flight. Evicted rows are handed back to the
    caller, which writes the dirty ones to the tier below.

    Example::

        cache = RowCache(width=8, capacities=[100, None], lfu=[False, False], device="cpu")
        slots = cache.insert(Rows(tables, ids, values, dirty), pinned=np.array([], dtype=np.int64))[0]
    """

    def __init__(
        self,
        width: int,
        capacities: list[int | None],
        lfu: list[bool],
        device: torch.device | str,
        initial_slots: int = 1024,
    ) -> None:
        self.width = width
        self.device = torch.device(device)
        self.capacity = np.array([-1 if c is None else c for c in capacities], dtype=np.int64)
        self.lfu = np.array(lfu, dtype=bool)
        self.index = KeyIndex(initial_slots)
        self.occupancy = np.zeros(len(capacities), dtype=np.int64)
        self.clock = 0
        # A fully bounded tier takes its whole budget at once; it never needs to grow.
        self._allocate(int(self.capacity.sum()) if (self.capacity >= 0).all() else initial_slots)

    def _allocate(self, slots: int) -> None:
        self.values = torch.zeros(slots, self.width, device=self.device)
        self.slot_table = np.full(slots, -1, dtype=np.int64)
        self.slot_id = np.full(slots, -1, dtype=np.int64)
        self.dirty = np.zeros(slots, dtype=bool)
        self.last_used = np.zeros(slots, dtype=np.int64)
        self.uses = np.zeros(slots, dtype=np.int64)
        self.free = np.arange(slots - 1, -1, -1, dtype=np.int64)  # a stack: pop from the end
        self.index.clear()
        self.occupancy[:] = 0

    def __len__(self) -> int:
        return int(self.occupancy.sum())

    @property
    def bounded(self) -> bool:
        return bool((self.capacity >= 0).any())

    def lookup(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return self.index.lookup(ids, tables)

    def touch(self, slots: np.ndarray) -> None:
        self.clock += 1
        self.last_used[slots] = self.clock
        self.uses[slots] += 1

    def room_needed(self, tables: np.ndarray) -> np.ndarray:
        """Per table, how many rows must go before ``tables`` (one entry per new row) fit."""
        incoming = np.bincount(tables, minlength=len(self.capacity))
        over = self.occupancy + incoming - self.capacity
        return np.where(self.capacity >= 0, np.maximum(over, 0), 0)

    def choose_victims(self, need: np.ndarray, pinned: np.ndarray, names: list[str]) -> tuple[np.ndarray, Rows]:
        """``need[t]`` unpinned rows of each table t to evict: ``(slots, rows)``.

        The caller writes the dirty ones below, then calls :meth:`release`, so a failed
        write leaves them here.
        """
        if not need.any():
            empty = np.empty(0, dtype=np.int64)
            return empty, self._rows(empty)
        owner = self.slot_table
        candidate = owner >= 0
        candidate[pinned] = False
        candidate &= need[np.maximum(owner, 0)] > 0
        slots = np.flatnonzero(candidate)
        score = np.where(self.lfu[owner[slots]], self.uses[slots], self.last_used[slots])
        order = np.lexsort((self.last_used[slots], score, owner[slots]))
        slots, tables = slots[order], owner[slots[order]]
        start = np.searchsorted(tables, np.arange(len(need)))
        available = np.bincount(tables, minlength=len(need))
        short = np.flatnonzero(available < need)
        if len(short):
            t = int(short[0])
            raise RuntimeError(
                f"table {names[t]!r}: one batch touches more rows than its tier holds "
                f"({int(self.capacity[t])} rows); raise the capacity or lower the batch size"
            )
        victims = slots[np.arange(len(slots)) - start[tables] < need[tables]]
        return victims, self._rows(victims)

    def release(self, slots: np.ndarray) -> None:
        tables = self.slot_table[slots]
        self.index.remove(self.slot_id[slots], tables)
        self.occupancy -= np.bincount(tables, minlength=len(self.occupancy))
        self.slot_table[slots] = -1
        self.slot_id[slots] = -1
        self.dirty[slots] = False
        self.free = np.concatenate([self.free, slots])

    def insert(self, rows: Rows) -> np.ndarray:
        """Place rows whose room was made with :meth:`evict`; overwrite those present."""
        slots = self.lookup(rows.tables, rows.ids)
        new = slots < 0
        n_new = int(new.sum())
        if n_new > len(self.free):
            self._grow(len(self) + n_new)
        fresh = self.free[len(self.free) - n_new :][::-1].copy()
        self.free = self.free[: len(self.free) - n_new]
        slots[new] = fresh
        self.index.insert(rows.ids[new], rows.tables[new], fresh)
        self.slot_table[fresh] = rows.tables[new]
        self.slot_id[fresh] = rows.ids[new]
        self.occupancy += np.bincount(rows.tables[new], minlength=len(self.occupancy))
        self.uses[fresh] = 0
        self.last_used[fresh] = self.clock
        self.values[torch.from_numpy(slots).to(self.device)] = rows.values.to(self.device)
        self.dirty[slots] |= rows.dirty
        return slots

    def _grow(self, needed: int) -> None:
        old = len(self.slot_table)
        size = max(needed, 2 * old)
        self.values = torch.cat([self.values, torch.zeros(size - old, self.width, device=self.device)])
        self.slot_table = np.concatenate([self.slot_table, np.full(size - old, -1, dtype=np.int64)])
        self.slot_id = np.concatenate([self.slot_id, np.full(size - old, -1, dtype=np.int64)])
        self.dirty = np.concatenate([self.dirty, np.zeros(size - old, dtype=bool)])
        self.last_used = np.concatenate([self.last_used, np.zeros(size - old, dtype=np.int64)])
        self.uses = np.concatenate([self.uses, np.zeros(size - old, dtype=np.int64)])
        self.free = np.concatenate([np.arange(size - 1, old - 1, -1, dtype=np.int64), self.free])

    def _rows(self, slots: np.ndarray) -> Rows:
        index = torch.from_numpy(slots).to(self.device)
        return Rows(self.slot_table[slots].copy(), self.slot_id[slots].copy(),
                    self.values.index_select(0, index), self.dirty[slots].copy())

    def entries(self) -> Rows:
        """Every row held, for checkpoints."""
        return self._rows(np.flatnonzero(self.slot_table >= 0))

    def clear(self) -> None:
        self._allocate(len(self.slot_table))

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()
