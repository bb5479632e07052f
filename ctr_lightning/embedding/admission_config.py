"""Which new ids of a table get a stored row: the admission setting, per table."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ctr_lightning.checkpoint_safe import checkpoint_safe

# Counters are one byte: an id is admitted after at most this many sightings.
MAX_ADMIT_AFTER = 255


@checkpoint_safe
@dataclass(frozen=True)
class Admission:
    """Feature admission of one table (or of every table, when given once): rare ids get
    no row, so they cost neither memory nor SSD (DeepRec's counter and probability
    filters, Monolith's frequency filter).

    An id not admitted reads a row of zeros (its bag pools it as zeros: a mean still counts
    it) and receives no update; it is stored nowhere and costs no per-id memory. Only
    training lookups count as sightings; evaluation and predict read zeros for ids stored
    nowhere. Decisions are a pure function of the training batches, the seed and the
    table's step count, so a resumed run and a run sharded over ranks admit exactly what
    one uninterrupted process admits. Under ``sparse_sync="k_step"`` the owners decide at each
    merge, on every rank's sightings of the interval (rows train locally until then).

    Args:
        admit_after: an id gets a row at its ``admit_after``-th sighting (counted over
            every occurrence in training batches, that batch's included, so it trains from
            that step on). 1 admits every id at once. Counted in a count-min sketch of
            ``sketch_bytes``: rare ids that collide with others may be admitted early, never late.
        probability: each sighting admits an id with this probability (1: always), drawn
            from a hash of (seed, table, id, step): deterministic, no per-id memory.
        sketch_bytes: memory of the sighting counters of a table (split over the ranks that
            own its rows); at least 645,120 bytes.
        halve_every: halve every counter each time the table's training step count passes
            a multiple of this, as TinyLFU's reset does: ids seen long ago fade, so a sketch
            of fixed size does not fill up over a run without end and start admitting ids
            at their first sighting. An id then needs about ``admit_after`` sightings within
            ``halve_every`` steps. Applied between steps, the same on every rank and after a
            resume. None (the default): the table's :class:`Expiry` ttl where it counts
            training steps (sightings age as stored rows do: a row not looked up in a ttl
            goes, so a sighting a ttl ago counts for little), else never. 0: never (counters
            only grow). A save finding a sketch over half in use warns, once a table.
        seed: seeds the sketch's hashes and the probability draws.

    Example::

        TieredEmbeddingBagCollection(tables, admission=Admission(admit_after=2))
        TieredEmbeddingBagCollection(tables, admission={"user": Admission(probability=0.2), "ad": None})
    """

    admit_after: int = 1
    probability: float = 1.0
    sketch_bytes: int = 4 << 20
    seed: int = 0
    halve_every: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.admit_after <= MAX_ADMIT_AFTER:
            raise ValueError(f"Admission.admit_after must be in [1, {MAX_ADMIT_AFTER}], got {self.admit_after}")
        if not 0 < self.probability <= 1:
            raise ValueError(f"Admission.probability must be in (0, 1], got {self.probability}")
        if self.halve_every is not None and (isinstance(self.halve_every, bool) or not isinstance(self.halve_every, int)
                                             or self.halve_every < 0 or (self.halve_every and self.admit_after < 2)):
            raise ValueError(f"Admission.halve_every ages the sighting counters of admit_after > 1: it must be a "
                             f"number of steps >= 1 with admit_after >= 2 (0: never), got "
                             f"halve_every={self.halve_every!r}, admit_after={self.admit_after}")
        if self.admit_after > 1 and self.probability < 1:
            raise ValueError(f"Admission: admit_after ({self.admit_after}) and probability ({self.probability}) are "
                             f"two modes; set one")

    @property
    def counts(self) -> bool:
        """Whether sightings are counted (``admit_after`` > 1)."""
        return self.admit_after > 1

    def aged_with(self, ttl_steps: int | None) -> Admission:
        """This setting with ``halve_every`` resolved for a table whose ttl is ``ttl_steps``
        training steps (None: none, or one in data time): a whole number of steps, 0 for
        counters that only grow. Resolving a resolved setting changes nothing."""
        if not self.counts:
            return replace(self, halve_every=0)
        if self.halve_every is None:
            return replace(self, halve_every=ttl_steps or 0)
        return self

    @property
    def filters(self) -> bool:
        """Whether any id is held back at all."""
        return self.admit_after > 1 or self.probability < 1
