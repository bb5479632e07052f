"""What one rank's training steps of a k-step interval saw, for the owners to decide on at
the merge: each row's occurrences (admission's sightings) and each step's newest event time
(a ttl in data time)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from ctr_lightning.embedding.tiers.key_index import KeyIndex, dedup


class IntervalRecord:
    """One rank's record of the training steps since the last merge.

    The steps are cut into *segments* wherever a table that halves its sighting counters
    (``halve_every[t] > 0``) enters a new halving period, and sightings are counted per
    segment: an owner adds each segment's sightings to its sketch aged to that segment's
    first step, so the counters hold what one process's would whenever the merges fall
    (a checkpoint merges early). Without halving there is one segment.

    Example::

        record = IntervalRecord(groups=2, halve_every=np.array([0, 100]))
        record.note_step(stamped, seconds)                  # each training forward, first
        record.note_sightings(g, tables, ids, occurrences)  # its rows (group g's tables)
        counts = record.sightings(g, tables, ids)           # [n, segments], at the merge
        record.clear()                                      # after it
    """

    def __init__(self, groups: int, halve_every: np.ndarray) -> None:
        self.halve_every = np.asarray(halve_every, dtype=np.int64)
        self.halving = self.halve_every > 0
        self._sightings: list[list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]] = [[] for _ in range(groups)]
        self.stamped: list[np.ndarray] = []         # per training step: the tables' step counts before it
        self.times: list[float | None] = []         # per training step: this rank's newest event time
        self.segment_starts: list[np.ndarray] = []  # per segment: the tables' step counts at its first step

    @property
    def segments(self) -> int:
        return max(len(self.segment_starts), 1)

    def note_step(self, stamped: np.ndarray, seconds: float | None, step: int | None = None) -> None:
        """A training step begins: ``stamped``, the tables' step counts (what its lookups
        stamp); ``seconds``, this rank's newest event time of its batch (None: none);
        ``step``, the step's number, the same on every rank (default: ``stamped``), which
        the segments are cut on (a rank that skipped a step on a non-finite gradient counts
        one step fewer in ``stamped``, and every rank must send the same segments)."""
        stamped = np.asarray(stamped, dtype=np.int64).copy()
        at = stamped if step is None else np.full(len(stamped), step, dtype=np.int64)
        every = np.maximum(self.halve_every, 1)
        if not self.segment_starts or np.any((at // every != self.segment_starts[-1] // every) & self.halving):
            self.segment_starts.append(at)
        self.stamped.append(stamped)
        self.times.append(seconds)

    def note_sightings(self, g: int, tables: np.ndarray, ids: np.ndarray, occurrences: np.ndarray) -> None:
        """The rows (unique) of group ``g`` this step looks up and their occurrences in its batch."""
        self._sightings[g].append((tables, ids, occurrences, self.segments - 1))

    def sightings(self, g: int, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """``[n, segments]``: this rank's occurrences of these rows (group ``g``) in each segment."""
        out = np.zeros((len(ids), self.segments), dtype=np.int64)
        seen = self._sightings[g]
        if not seen:
            return out
        all_tables = np.concatenate([s[0] for s in seen])
        all_ids = np.concatenate([s[1] for s in seen])
        first, inverse = dedup(all_tables, all_ids)
        index = KeyIndex()
        index.insert(all_tables[first], all_ids[first], np.arange(len(first), dtype=np.int64))
        at = index.lookup(tables, ids)
        segment = np.concatenate([np.full(len(s[1]), s[3], dtype=np.int64) for s in seen])
        totals = np.zeros((len(first), self.segments), dtype=np.int64)
        np.add.at(totals, (inverse, segment), np.concatenate([s[2] for s in seen]).astype(np.int64))
        found = at >= 0
        out[found] = totals[at[found]]
        return out

    def times_over_ranks(self, process_group: dist.ProcessGroup, timed: list[str]) -> list[tuple[np.ndarray, float]]:
        """Per training step: its step counts and its newest event time over all ranks.
        Collective; a step no rank's batch gave an event time is refused on every rank,
        naming the tables ``timed`` whose ttl counts in data time."""
        newest = torch.tensor([-math.inf if t is None else t for t in self.times], dtype=torch.float64)
        dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=process_group)
        missing = [k for k, t in enumerate(newest.tolist()) if math.isinf(t)]
        if missing:
            step = int(self.stamped[missing[0]].max()) + 1
            raise ValueError(f"tables {timed}: the ttl counts in data time, but training step {step} carried no "
                             f"event time on any rank; give the DataModule an event_time_column, or "
                             f"partition_time=True for dt=/hour= partitions (your own loop: observe_event_time "
                             f"before each training forward), or set the ttl in steps")
        return list(zip(self.stamped, newest.tolist()))

    def segment_steps(self) -> np.ndarray:
        """``[segments, tables]``: the tables' step counts at each segment's first step."""
        return np.stack(self.segment_starts) if self.segment_starts else np.zeros((1, len(self.halve_every)), np.int64)

    def clear(self) -> None:
        for seen in self._sightings:
            seen.clear()
        self.stamped, self.times, self.segment_starts = [], [], []
