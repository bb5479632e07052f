"""Which stored rows of a table go: the expiry setting, per table."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ctr_lightning.checkpoint_safe import checkpoint_safe

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``"7d"``, ``"12h"``, ``"30m"`` or ``"90s"``."""
    match = _DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"Expiry.ttl {text!r} is neither a whole number of training steps nor a duration "
                         f"of data time such as '7d', '12h', '30m' or '90s'")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


SCORES = ("lru", "lfu", "show_click")


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
    its thread, never on the step's path. Under ``sparse_sync="k_step"`` the rows' last
    lookups, their scores (each rank's lookups of an interval added up at the owner) and
    the floors move at merges, so a resumed run keeps the rows an uninterrupted one keeps
    (a ttl in data time needs ``sparse_sync="step"``).

    ``Expiry()`` with neither setting expires nothing, but its rows record their last
    lookup step all the same: what delta exports for serving need (``ctr-lightning export
    --since``, :class:`~ctr_lightning.callbacks.ServingExport`), since a row's weights change
    only at a training lookup.

    Args:
        ttl: a row not looked up in ``ttl`` training steps expires: a row last looked up
            at step ``s`` is still there at step ``s + ttl`` and gone at step ``s + ttl + 1``.
            A duration (``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``) counts in data time
            instead: a row goes once the newest event time trained is more than ``ttl``
            past the newest event time seen up to the row's last lookup. The training
            batches must then carry event times (``Batch.event_time``: a DataModule's
            ``event_time_column``, or ``partition_time=True`` for ``dt=``/``hour=``
            partitions; in your own loop, :meth:`TieredEmbeddingBagCollection.observe_event_time`).
        max_rows: at most this many rows stored; above it the lowest-scoring rows go, all
            rows of one score together (of one step, under LRU), so the table may hold a
            batch's worth fewer. Must exceed the rows one batch touches.
        score: what ``max_rows`` keeps: ``"lru"`` (the most recently looked-up rows),
            ``"lfu"`` (the most looked-up: each training lookup adds the row's occurrences
            in the batch) or ``"show_click"`` (PaddleBox's: each lookup adds
            ``nonclick_weight * (shows - clicks) + click_weight * clicks``, the clicks from
            the batch's labels). Scores decay by ``decay`` a training step, so old counts
            fade (with no decay, LFU keeps the rows that were popular once, and a new id
            scores below them all). A score cap takes no ttl: the decay ages rows instead.
            Rows of equal score (within 1/16 of a doubling) go together.
        decay: the factor a score keeps from one training step to the next, in (0, 1].
        click_weight: what a click adds to a ``"show_click"`` score.
        nonclick_weight: what a show without a click adds to a ``"show_click"`` score.

    Example::

        TieredEmbeddingBagCollection(tables, expiry=Expiry(ttl=50_000))
        TieredEmbeddingBagCollection(tables, expiry=Expiry(ttl="7d"))   # in data time
        TieredEmbeddingBagCollection(tables, expiry={"user": Expiry(max_rows=10**8), "ad": Expiry()})
        Expiry(max_rows=10**8, score="show_click", decay=0.9999)       # PaddleBox's shrink
    """

    ttl: int | str | None = None
    max_rows: int | None = None
    score: str = "lru"
    decay: float = 1.0
    click_weight: float = 1.0
    nonclick_weight: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.ttl, str):
            parse_duration(self.ttl)
        elif self.ttl is not None and (isinstance(self.ttl, bool) or not isinstance(self.ttl, int) or self.ttl < 1):
            raise ValueError(f"Expiry.ttl must be a whole number of training steps >= 1 or a duration such as "
                             f"'7d', got {self.ttl!r}")
        if self.max_rows is not None and (isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int)
                                          or self.max_rows < 1):
            raise ValueError(f"Expiry.max_rows must be a whole number >= 1, got {self.max_rows!r}")
        if self.score not in SCORES:
            raise ValueError(f"Expiry.score must be one of {SCORES}, got {self.score!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"Expiry.decay must be in (0, 1], got {self.decay!r}")
        if self.click_weight <= 0 or self.nonclick_weight <= 0:
            raise ValueError(f"Expiry.click_weight and nonclick_weight must be > 0, got {self.click_weight!r}, "
                             f"{self.nonclick_weight!r}")
        if self.scored and (self.max_rows is None or self.ttl is not None):
            raise ValueError(f"Expiry(score={self.score!r}) ranks the rows max_rows keeps: give max_rows, and no ttl "
                             f"(the score's decay ages rows instead)")

    @property
    def scored(self) -> bool:
        """Whether rows are kept by a score (LFU, show/click) rather than by recency."""
        return self.score != "lru"


    @property
    def ttl_steps(self) -> int | None:
        """The ttl in training steps (None: none, or one in data time)."""
        return self.ttl if isinstance(self.ttl, int) else None

    @property
    def ttl_seconds(self) -> float | None:
        """The ttl in seconds of data time (None: none, or one in training steps)."""
        return parse_duration(self.ttl) if isinstance(self.ttl, str) else None
