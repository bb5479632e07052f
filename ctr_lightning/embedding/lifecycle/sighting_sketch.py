"""Sightings of ids not stored yet, counted in bounded memory (a count-min sketch)."""

from __future__ import annotations

import numba
import numpy as np

from ctr_lightning.embedding.initializer import table_key
from ctr_lightning.hashing import splitmix64_one

# The sketch is cut into this many partitions by the same hash that picks a row-wise
# table's owner (sharding_plan.row_owner), and an id's counters lie in its partition.
# Every world size that divides it (1-10, 12, 14, 15, 16, ..., 64, 128, ...) gives each
# partition one owner, so an owner's counters are exactly those one process would have:
# collisions happen between ids of one owner only.
PARTITIONS = 40320  # 8!
DEPTH = 2
MIN_WIDTH = 8
_GOLDEN = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64, as row_owner multiplies


def min_sketch_bytes() -> int:
    return PARTITIONS * DEPTH * MIN_WIDTH


class SightingSketch:
    """Saturating one-byte counters of (id) sightings for one table, the partitions one
    rank owns. Adding is commutative, so the order ids arrive in (which rank sent them)
    changes nothing.

    Example::

        sketch = SightingSketch("user", sketch_bytes=4 << 20, seed=0)
        counts = sketch.add(ids, occurrences)   # each id's count, this batch's included
    """

    def __init__(self, table: str, sketch_bytes: int, seed: int, world: int = 1, rank: int = 0) -> None:
        if PARTITIONS % world:
            raise ValueError(f"table {table!r}: admission counts sightings in {PARTITIONS} partitions, one owner each; "
                             f"{world} ranks do not divide them (use a world size dividing {PARTITIONS}, or "
                             f"table_wise sharding for this table)")
        width = sketch_bytes // (PARTITIONS * DEPTH)
        if width < MIN_WIDTH:
            raise ValueError(f"table {table!r}: Admission.sketch_bytes {sketch_bytes} is below the minimum "
                             f"{min_sketch_bytes()} ({PARTITIONS} partitions x {DEPTH} rows x {MIN_WIDTH} counters)")
        self.table, self.world, self.rank, self.width = table, world, rank, width
        key = np.uint64(table_key(table))
        self.seeds = np.array([splitmix64_one(splitmix64_one(np.uint64(seed) ^ key) + np.uint64(j))
                               for j in range(DEPTH)], dtype=np.uint64)
        self.counts = np.zeros((PARTITIONS // world, DEPTH, width), dtype=np.uint8)
        # How many times every counter was halved (Admission.halve_every); None: counters
        # loaded from a run that did not halve them, whose halvings start at the next count.
        self.halvings: int | None = 0

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes

    def age(self, halvings: int) -> None:
        """Halve every counter until ``halvings`` halvings are applied in all. Halving k times
        at once equals k single halvings (an integer shift), so halving lazily, at the next
        count, gives what halving at every due step would."""
        if self.halvings is None:
            self.halvings = halvings
        due = halvings - self.halvings
        if due > 0:
            self.counts >>= min(due, 8)
            self.halvings = halvings

    def add(self, ids: np.ndarray, occurrences: np.ndarray) -> np.ndarray:
        """Count ``occurrences[i]`` sightings of each of ``ids`` (unique, owned here); returns
        each id's estimated count afterwards (never below the true count, up to 255)."""
        return _add_and_count(self.counts, self.seeds, ids.astype(np.int64, copy=False),
                              occurrences.astype(np.int64, copy=False), self.world)

    def state(self) -> np.ndarray:
        """``[PARTITIONS, DEPTH, width]``: the counters of every partition, zeros in those
        other ranks own (add the ranks' states to join them)."""
        full = np.zeros((PARTITIONS, DEPTH, self.width), dtype=np.uint8)
        full[self.rank::self.world] = self.counts
        return full

    def load(self, state: np.ndarray) -> None:
        """Take this rank's partitions of a joined :meth:`state` (of any world size)."""
        if state.shape != (PARTITIONS, DEPTH, self.width):
            raise ValueError(f"table {self.table!r}: checkpointed sighting counters have shape {tuple(state.shape)}, "
                             f"this admission setting makes {(PARTITIONS, DEPTH, self.width)} (Admission.sketch_bytes "
                             f"changed?)")
        self.counts = np.ascontiguousarray(state[self.rank::self.world])


@numba.njit(cache=True, nogil=True)
def _add_and_count(counts, seeds, ids, occurrences, world):
    width = counts.shape[2]
    n = len(ids)
    part = np.empty(n, dtype=np.int64)
    cols = np.empty((n, len(seeds)), dtype=np.int64)
    for i in range(n):
        mixed = ids[i] * _GOLDEN  # wraps, as row_owner's
        part[i] = (((mixed >> 32) & 0x7FFFFFFF) % PARTITIONS) // world
        for j in range(len(seeds)):
            cols[i, j] = np.int64(splitmix64_one(np.uint64(ids[i]) ^ seeds[j]) % np.uint64(width))
    for i in range(n):  # all adds first: a count read below includes this whole batch
        for j in range(len(seeds)):
            c = np.int64(counts[part[i], j, cols[i, j]]) + occurrences[i]
            counts[part[i], j, cols[i, j]] = 255 if c > 255 else c
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        low = 255
        for j in range(len(seeds)):
            low = min(low, np.int64(counts[part[i], j, cols[i, j]]))
        out[i] = low
    return out
