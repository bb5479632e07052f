"""Which of a group's new rows are admitted: per table, by sightings or by chance."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from ctr_lightning.embedding.admission_config import Admission
from ctr_lightning.embedding.initializer import table_key
from ctr_lightning.embedding.lifecycle.sighting_sketch import SightingSketch
from ctr_lightning.hashing import splitmix64

HALVINGS = ":halvings"  # the key of a table's halvings beside its counters in state()
# The share of a sketch's counters in use (after the halvings due) above which a save warns.
FULL_WARNING = 0.5


class AdmissionGate:
    """The admission of one table group's tables (:class:`Admission`, None: every id).

    ``partitions[t]`` is ``(world, rank)`` for a row-wise shard of table t, ``(1, 0)``
    where one process holds all its ids.

    Example::

        gate = AdmissionGate(["user", "ad"], [Admission(admit_after=2), None], [(1, 0), (1, 0)])
        admitted = gate.admit(tables, ids, sightings, steps)   # rows stored nowhere yet
    """

    def __init__(self, names: Sequence[str], settings: Sequence[Admission | None],
                 partitions: Sequence[tuple[int, int]]) -> None:
        self.names = list(names)
        self.settings = [s if s is not None and s.filters else None for s in settings]
        self.sketches = [SightingSketch(n, s.sketch_bytes, s.seed, *p) if s is not None and s.counts else None
                         for n, s, p in zip(self.names, self.settings, partitions)]
        self.filtering = np.array([s is not None for s in self.settings], dtype=bool)
        self.per_table = {n: {"admitted": 0, "rejected": 0} for n, s in zip(self.names, self.settings) if s is not None}
        self._warned_full: set[str] = set()

    @property
    def active(self) -> bool:
        return bool(self.filtering.any())

    @property
    def counters(self) -> dict[str, int]:
        """Rows admitted and rejected so far, over this group's tables."""
        return {"rows_admitted": sum(c["admitted"] for c in self.per_table.values()),
                "rows_rejected": sum(c["rejected"] for c in self.per_table.values())}

    def table_counts(self) -> dict[str, dict[str, int]]:
        """Per filtering table, rows ``admitted`` and ``rejected`` so far; where sightings
        are counted, also the sketch's ``counters`` and ``counters_used`` (not zero): a
        sketch far over half in use admits many ids at their first sighting."""
        out = {name: dict(counts) for name, counts in self.per_table.items()}
        for name, sketch in zip(self.names, self.sketches):
            if sketch is not None:
                out[name].update(counters=int(sketch.counts.size), counters_used=int(np.count_nonzero(sketch.counts)))
        return out

    def admit(self, tables: np.ndarray, ids: np.ndarray, sightings: np.ndarray | None,
              steps: np.ndarray, segment_steps: np.ndarray | None = None) -> np.ndarray:
        """Which of these rows, stored nowhere, get a row now. ``sightings``: each one's
        occurrences in this training batch (None: not training, so nothing is admitted
        where a table filters); ``steps``: the tables' step counts (the draws' clock).

        Under k-step tables, at a merge, ``sightings`` is ``[n, segments]``: the interval's
        over all ranks, per segment of its steps (:class:`IntervalRecord`), and
        ``segment_steps[j]`` the tables' step counts at segment j's first step: each
        segment's sightings reach the counters aged to that step, as one process's would."""
        admitted = ~self.filtering[tables]
        if sightings is None:
            return admitted
        if sightings.ndim == 1:
            sightings, segment_steps = sightings[:, None], np.asarray(steps)[None]
        for t in np.unique(tables[self.filtering[tables]]):
            mine = np.flatnonzero(tables == t)
            admitted[mine] = self._decide(int(t), ids[mine], sightings[mine], segment_steps[:, t], int(steps[t]))
            taken = int(admitted[mine].sum())
            self.per_table[self.names[t]]["admitted"] += taken
            self.per_table[self.names[t]]["rejected"] += len(mine) - taken
        return admitted

    def _decide(self, table: int, ids: np.ndarray, sightings: np.ndarray, segment_steps: np.ndarray,
                step: int) -> np.ndarray:
        setting = self.settings[table]
        sketch = self.sketches[table]
        if sketch is not None:
            # Admitted where the count reaches admit_after in any segment, as one process
            # admits at the step it does, even if a halving after it brings the count down.
            admitted = np.zeros(len(ids), dtype=bool)
            for j in range(sightings.shape[1]):
                self._age(table, int(segment_steps[j]))
                admitted |= sketch.add(ids, sightings[:, j]) >= setting.admit_after
            return admitted
        sightings = sightings.sum(axis=1)
        # Each of the c sightings admits with probability p: 1 - (1 - p)^c in all, one draw
        # per (seed, table, id, step).
        chance = 1.0 - (1.0 - setting.probability) ** sightings.astype(np.float64)
        key = splitmix64(np.uint64(setting.seed) ^ splitmix64(np.uint64(step) + np.uint64(table_key(self.names[table]))))
        draw = (splitmix64(ids.astype(np.uint64) ^ key) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return draw < chance

    def state(self, steps: np.ndarray) -> dict[str, np.ndarray]:
        """Per counting table, its sketch's :meth:`SightingSketch.state`, aged to the tables'
        step counts ``steps``; where counters are halved (``Admission.halve_every``), also
        ``"<table>:halvings"``, the halvings in them (``[1]`` int64: ranks' entries join by
        their maximum, as the counters do)."""
        out = {}
        for t, (name, setting, sketch) in enumerate(zip(self.names, self.settings, self.sketches)):
            if sketch is None:
                continue
            if setting.halve_every:
                self._age(t, int(steps[t]))
                out[name + HALVINGS] = np.array([sketch.halvings], dtype=np.int64)
            self._warn_if_full(name, sketch, setting.halve_every)
            out[name] = sketch.state()
        return out

    def _warn_if_full(self, name: str, sketch: SightingSketch, halve_every: int) -> None:
        """Counters over half in use after the halvings due: warned once a table, since
        admission then quietly stops filtering (bench_sketch_aging: 94% of once-seen ids
        admitted with 98% in use)."""
        used = np.count_nonzero(sketch.counts) / sketch.counts.size
        if used <= FULL_WARNING or name in self._warned_full:
            return
        self._warned_full.add(name)
        remedy = (f"halved every {halve_every} steps, they still fill: halve more often or give a larger sketch_bytes"
                  if halve_every else "they only grow: set Admission.halve_every (steps) so they age, or a larger "
                                      "sketch_bytes")
        warnings.warn(f"table {name!r}: admission's sighting counters are {used:.0%} in use, so more and more ids are "
                      f"admitted at their first sighting; {remedy}", stacklevel=2)

    def _age(self, table: int, step: int) -> None:
        """Table ``table``'s counters with every halving due by its step count ``step``."""
        every = self.settings[table].halve_every
        if every:
            self.sketches[table].age(step // every)

    def load(self, state: dict[str, np.ndarray]) -> None:
        for name, sketch in zip(self.names, self.sketches):
            if sketch is None:
                continue
            if name not in state:
                raise KeyError(f"table {name!r} counts sightings (Admission.admit_after > 1) but the checkpoint holds "
                               f"no counters for it (saved without admission?)")
            sketch.load(np.asarray(state[name]))
            # Saved without halving: the halvings start from the next count's step.
            halvings = state.get(name + HALVINGS)
            sketch.halvings = int(np.asarray(halvings).reshape(-1)[0]) if halvings is not None else None
