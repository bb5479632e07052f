"""Which stored rows of a table go: the expiry setting, per table."""

from __future__ import annotations

from dataclasses import dataclass

from ctr_lightning.checkpoint_safe import checkpoint_safe


@checkpoint_safe
@dataclass(frozen=True)
class Expiry:
    """Row expiry and a row cap for one table (or every table, when given once), so an
    online run's tables reach a steady size instead of filling the disk (TorchRec's and
    FBGEMM's TTL eviction, DeepRec's global-step eviction, PaddleBox's shrink).

    A row is *looked up* when a training batch holds its id; evaluation and predict never
    count. A row that expires is stored nowhere from then on: it reads what an id never
    seen reads (its initial row, or zeros in a table with :class:`Admission`) and, looked
    up again, starts over (through admission, where the table has it). Decisions are a
    pure function of the training batches and the table's step count, so a resumed run and
    a run sharded row-wise over ranks keep exactly the rows one uninterrupted process keeps.
    The rows' last lookup step travels with the row (8 bytes a row, in memory and in its
    SSD record); the SSD files of expired rows are deleted by the SSD log's cleaning, in
    its thread, never on the step's path.

    ``Expiry()`` with neither setting expires nothing, but its rows record their last
    lookup step all the same: what delta exports for serving need (``ctr-lightning export
    --since``, :class:`~ctr_lightning.callbacks.ServingExport`), since a row's weights change
    only at a training lookup.

    Args:
        ttl: a row not looked up in ``ttl`` training steps expires: a row last looked up
            at step ``s`` is still there at step ``s + ttl`` and gone at step ``s + ttl + 1``.
        max_rows: at most this many rows stored; above it the least recently looked-up
            rows go (LRU), all rows of one step together, so the table may hold a batch's
            worth fewer. Must exceed the rows one batch touches.

    Example::

        TieredEmbeddingBagCollection(tables, expiry=Expiry(ttl=50_000))
        TieredEmbeddingBagCollection(tables, expiry={"user": Expiry(max_rows=10**8), "ad": Expiry()})
    """

    ttl: int | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.ttl is not None and (isinstance(self.ttl, bool) or not isinstance(self.ttl, int) or self.ttl < 1):
            raise ValueError(f"Expiry.ttl must be a whole number of training steps >= 1, got {self.ttl!r}")
        if self.max_rows is not None and (isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int)
                                          or self.max_rows < 1):
            raise ValueError(f"Expiry.max_rows must be a whole number >= 1, got {self.max_rows!r}")

