"""Rows read ahead from the SSD tier, held in DRAM until the batch that needs them runs."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ctr_lightning.embedding.key_index import KeyIndex


@dataclass(frozen=True)
class StagedChunk:
    """Rows a prefetch thread read for one upcoming batch, with the tokens that tell
    whether the SSD copy they came from is still the current one."""

    batch: int
    tables: np.ndarray
    ids: np.ndarray
    tokens: np.ndarray
    rows: np.ndarray  # float32 [n, width]


class StagedRows:
    """The hand-off between a prefetch thread and the training thread.

    The prefetch thread only calls :meth:`put` (a deque append, safe across threads).
    Everything else runs on the training thread: :meth:`take` serves rows whose SSD
    copy is unchanged since they were read (a write-back or compaction in between
    makes them stale, and they are dropped), and :meth:`release` forgets the chunks of
    batches that have run.

    Example::

        staged = StagedRows()
        staged.put(StagedChunk(batch=7, tables=t, ids=i, tokens=tok, rows=r))   # prefetch thread
        found, rows, stale = staged.take(tables, ids, current_tokens=store_tokens)     # training thread
        staged.release(7)
    """

    def __init__(self) -> None:
        self._arrived: deque[StagedChunk] = deque()
        self._chunks: list[StagedChunk] = []
        self._index: KeyIndex | None = None  # (table, id) -> position in the concatenated chunks
        self._tokens = np.empty(0, dtype=np.int64)
        self._rows = np.empty((0, 0), dtype=np.float32)

    def put(self, chunk: StagedChunk) -> None:
        self._arrived.append(chunk)

    def _absorb(self) -> None:
        changed = False
        while self._arrived:
            self._chunks.append(self._arrived.popleft())
            changed = True
        if changed or self._index is None:
            self._rebuild()

    def _rebuild(self) -> None:
        self._index = KeyIndex()
        if not self._chunks:
            return
        tables = np.concatenate([c.tables for c in self._chunks])
        ids = np.concatenate([c.ids for c in self._chunks])
        self._tokens = np.concatenate([c.tokens for c in self._chunks])
        self._rows = np.concatenate([c.rows for c in self._chunks])
        self._index.insert(ids, tables, np.arange(len(ids), dtype=np.int64))  # later chunks win

    def __len__(self) -> int:
        return sum(len(c.ids) for c in self._chunks) + sum(len(c.ids) for c in list(self._arrived))

    def take(self, tables: np.ndarray, ids: np.ndarray,
             current_tokens: Callable[[np.ndarray, np.ndarray], np.ndarray]
             ) -> tuple[np.ndarray, torch.Tensor, int]:
        """``(found mask, rows [found, width], stale)`` of the staged rows still current;
        ``stale`` counts those whose SSD copy changed after they were read."""
        self._absorb()
        found = np.zeros(len(ids), dtype=bool)
        if not self._chunks or not len(ids):
            return found, torch.empty(0), 0
        positions = self._index.lookup(ids, tables)
        hit = np.flatnonzero(positions >= 0)
        stale = 0
        if len(hit):
            fresh = current_tokens(tables[hit], ids[hit]) == self._tokens[positions[hit]]
            stale = int(len(hit) - fresh.sum())
            hit = hit[fresh]
        found[hit] = True
        return found, torch.from_numpy(self._rows[positions[hit]]), stale

    def release(self, batch: int) -> None:
        """Forget the rows read for batches up to ``batch``: they have run."""
        self._absorb()
        kept = [c for c in self._chunks if c.batch > batch]
        if len(kept) != len(self._chunks):
            self._chunks = kept
            self._rebuild()

    def clear(self) -> None:
        self._arrived.clear()
        self._chunks = []
        self._index = None
