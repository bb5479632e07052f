"""The device tier as one k-step interval's copy of rows other ranks own (KStepTables)."""

from __future__ import annotations

import numpy as np
import torch

from ctr_lightning.embedding.tiers.row_cache import RowCache, Rows


class IntervalRows:
    """Rows held in memory only, between two k-step merges: fetched from their owner
    (:meth:`hold`), trained locally, sent back (:meth:`changed`) and dropped (:meth:`forget`).
    They never go down to the host tier or SSD: they arrive clean, so eviction drops them.

    Example::

        interval = IntervalRows(device_tier)
        missing = interval.absent(tables, ids)
        interval.hold(tables[missing], ids[missing], rows_from_owner)
        updates = interval.changed()   # at the merge
        interval.forget()
    """

    def __init__(self, device_tier: RowCache) -> None:
        self.device_tier = device_tier

    def absent(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Which of these rows the device tier lacks."""
        return self.device_tier.lookup(tables, ids) < 0

    def hold(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Put rows into the device tier as clean copies (of rows owned elsewhere)."""
        self.device_tier.insert(Rows(tables, ids, rows, np.zeros(len(ids), dtype=bool)))

    def changed(self) -> Rows:
        """The device tier's rows written since they arrived."""
        entries = self.device_tier.entries()
        return entries.select(entries.dirty)

    def forget(self) -> None:
        """Drop every row of the device tier (between intervals)."""
        self.device_tier.clear()
