"""Rows read ahead from the SSD tier, held in DRAM until the batch that needs them runs."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ctr_lightning.embedding.tiers.key_index import KeyIndex


@dataclass(frozen=True)
class StagedChunk:
    """Rows a prefetch thread read for one upcoming batch, with the tokens that tell
    whether the SSD copy they came from is still the current one."""

    batch: int
    tables: np.ndarray
    ids: np.ndarray
    tokens: np.ndarray
    locations: np.ndarray  # the SSD record each was read from
    rows: np.ndarray  # float32 [n, width]


class StagedRows:
    """The hand-off between a prefetch thread and the training thread.

    The prefetch thread only calls :meth:`put` (a deque append, safe across threads),
    one chunk per upcoming batch, in batch order. Everything else runs on the training
    thread: :meth:`take` serves rows whose SSD copy is unchanged since they were read (a
    write-back or the SSD log's cleaning in between makes them stale, and they are dropped), and
    :meth:`release` forgets the chunks of batches that have run.

    Chunks live in one buffer in arrival order, indexed by (table, id); a later chunk's
    copy of a row wins. Arrivals and releases touch only their own chunk's rows; the
    buffer is compacted when full and then kept at least twice what it holds, so staging
    costs O(rows staged), amortized, not O(rows held) per batch.

    Example::

        staged = StagedRows()
        staged.put(StagedChunk(batch=7, tables=t, ids=i, tokens=tok, locations=loc, rows=r))   # prefetch thread
        found, rows, locations, stale = staged.take(tables, ids, current_tokens=store_tokens)  # training thread
        staged.release(7)
    """

    def __init__(self) -> None:
        self._arrived: deque[StagedChunk] = deque()
        self._chunks: deque[tuple[StagedChunk, int]] = deque()  # (chunk, position of its first row)
        self._index = KeyIndex()  # (table, id) -> position of its newest staged copy
        self._base = 0  # position of the buffers' first row; positions only grow
        self._end = 0  # position after the last row
        self._tokens = np.empty(0, dtype=np.int64)
        self._locations = np.empty(0, dtype=np.int64)
        self._rows = np.empty((0, 0), dtype=np.float32)

    def put(self, chunk: StagedChunk) -> None:
        self._arrived.append(chunk)

    def _absorb(self) -> None:
        while self._arrived:
            chunk = self._arrived.popleft()
            if self._chunks and chunk.batch < self._chunks[-1][0].batch:
                # release() drops a prefix of the chunks: that needs them in batch order.
                raise RuntimeError(f"StagedRows: rows for batch {chunk.batch} arrived after batch "
                                   f"{self._chunks[-1][0].batch}'s; chunks must arrive in batch order")
            n = len(chunk.ids)
            self._reserve(n, chunk.rows.shape[1])
            at = self._end - self._base
            self._rows[at : at + n] = chunk.rows
            self._tokens[at : at + n] = chunk.tokens
            self._locations[at : at + n] = chunk.locations
            self._index.insert(chunk.tables, chunk.ids, np.arange(self._end, self._end + n, dtype=np.int64))
            self._chunks.append((chunk, self._end))
            self._end += n

    def _reserve(self, n: int, width: int) -> None:
        """Room for ``n`` more rows at the end: drop released rows from the front, grow if
        that is not enough."""
        if self._end - self._base + n <= len(self._rows) and self._rows.shape[1] == width:
            return
        live = self._live
        held = self._end - live
        kept = slice(live - self._base, self._end - self._base)
        # At least twice what is held: the rows copied here are then paid for by as many
        # arrivals before the next compaction.
        if len(self._rows) >= 2 * (held + n) and self._rows.shape[1] == width:
            rows, tokens, locations = self._rows, self._tokens, self._locations
        else:
            rows = np.empty((2 * (held + n), width), dtype=np.float32)
            tokens = np.empty(2 * (held + n), dtype=np.int64)
            locations = np.empty(2 * (held + n), dtype=np.int64)
        if held:  # (the first chunk sets the width)
            rows[:held] = self._rows[kept]  # numpy copies overlapping slices safely
            tokens[:held] = self._tokens[kept]
            locations[:held] = self._locations[kept]
        self._rows, self._tokens, self._locations, self._base = rows, tokens, locations, live

    @property
    def _live(self) -> int:
        """Position of the oldest row not yet released."""
        return self._chunks[0][1] if self._chunks else self._end

    def __len__(self) -> int:
        return self._end - self._live + sum(len(c.ids) for c in list(self._arrived))

    def take(self, tables: np.ndarray, ids: np.ndarray,
             current_tokens: Callable[[np.ndarray, np.ndarray], np.ndarray]
             ) -> tuple[np.ndarray, torch.Tensor, np.ndarray, int]:
        """``(found mask, rows [found, width], locations [found], stale)`` of the staged rows
        still current; ``stale`` counts those whose SSD copy changed after they were read."""
        self._absorb()
        found = np.zeros(len(ids), dtype=bool)
        if not self._chunks or not len(ids):
            return found, torch.empty(0), np.empty(0, dtype=np.int64), 0
        positions = self._index.lookup(tables, ids)
        hit = np.flatnonzero(positions >= 0)
        stale = 0
        if len(hit):
            at = positions[hit] - self._base
            fresh = current_tokens(tables[hit], ids[hit]) == self._tokens[at]
            stale = int(len(hit) - fresh.sum())
            hit, at = hit[fresh], at[fresh]
        else:
            at = np.empty(0, dtype=np.int64)
        found[hit] = True
        return found, torch.from_numpy(self._rows[at]), self._locations[at], stale

    def release(self, batch: int) -> None:
        """Forget the rows read for batches up to ``batch``: they have run."""
        self._absorb()
        while self._chunks and self._chunks[0][0].batch <= batch:
            chunk, start = self._chunks.popleft()
            # Rows a later chunk staged again stay, with that chunk's copy.
            positions = self._index.lookup(chunk.tables, chunk.ids)
            own = (positions >= start) & (positions < start + len(chunk.ids))
            self._index.remove(chunk.tables[own], chunk.ids[own])

    def clear(self) -> None:
        self._arrived.clear()
        self._chunks.clear()
        self._index.clear()
        self._base = self._end = 0
