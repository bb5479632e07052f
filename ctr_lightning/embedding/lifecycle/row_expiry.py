"""Which stored rows of a group are gone: per table, a floor on the step each row was
last looked up at, raised by ``ttl`` and ``max_rows``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from typing import Any

import numpy as np
import torch

from ctr_lightning.embedding.expiry_config import Expiry

# Floats after a row's optimizer state that hold its last lookup step, plus one (0: never
# looked up in training), as two exact float32 integers of 24 bits: steps up to 2^48.
STAMP_WORDS = 2
_LOW_BITS = 24
_NO_FLOOR = -1  # tables without expiry: every stored row stays
# Tables kept by a score: one float after the stamp, log2 of the row's score scaled by
# decay^-step (so a decay that ages every score alike never reorders them, and no stored
# score is touched at a step). Rows rank by that key in buckets of 1/16 of a doubling.
SCORE_WORDS = 1
SCORE_BUCKETS = 16
_NEVER = -(1 << 62)  # the rank of a row never looked up in training: below every floor
_LOWEST = -(1 << 61)  # a score table's first floor: every row looked up is live
# A score key that holds nothing (2^key is 0 even in float64, so adding a score to it gives
# that score exactly) yet ranks above a table's first floor, which a k-step local copy never
# raises (it caps nothing: keep_all): a k-step local copy starts the rows it
# pulls from it, so its key counts this rank's lookups of the interval alone, with no
# rounding of the owner's score in it, and the owner adds the ranks' keys to its own.
FRESH_KEY = -(2.0 ** 40)


def read_last_seen(rows: torch.Tensor | np.ndarray, column: int) -> np.ndarray:
    """The step each row was last looked up at in training (-1: never), from its stamp."""
    words = rows[:, column : column + STAMP_WORDS]
    words = words.cpu().numpy() if isinstance(words, torch.Tensor) else np.asarray(words)
    return (words[:, 0].astype(np.int64) << _LOW_BITS) + words[:, 1].astype(np.int64) - 1


def score_bucket(keys: np.ndarray) -> np.ndarray:
    """The rank bucket of score keys (log2 of scaled scores)."""
    return np.floor(np.asarray(keys, dtype=np.float64) * SCORE_BUCKETS).astype(np.int64)


def merged_keys(base: np.ndarray, added: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Score keys of rows merged over ranks (k-step tables): ``log2(2^base[i] + sum of
    2^added[j] over j with rows[j] == i)``; ``base``: the owner's keys (-inf: it has no
    score), ``added``: each rank's key of the interval (begun at :data:`FRESH_KEY`). Scores
    scaled by ``decay^-step`` add in the linear domain whatever step each lookup came at, so
    no rank's lookups are lost and none counted twice. They are added in the order given
    (the ranks'), so every run with the same ranks gets the same floats."""
    out = np.asarray(base, dtype=np.float64).copy()
    np.logaddexp2.at(out, rows, np.asarray(added, dtype=np.float64))
    return out.astype(np.float32)


def stamp_words(steps: np.ndarray | int) -> np.ndarray:
    """The two stamp floats ``[n, 2]`` (``[2]`` for one) of rows last looked up at ``steps``."""
    mark = np.asarray(steps, dtype=np.int64) + 1
    return np.stack([mark >> _LOW_BITS, mark & ((1 << _LOW_BITS) - 1)], axis=-1).astype(np.float32)


class RowExpiry:
    """The expiry of one table group's tables (:class:`Expiry`; None: rows stay, and record
    no lookup step). Tables with an Expiry are *stamped*: each row records its last lookup.

    A stored row is *live* while the step it was last looked up at in training is at least
    its table's floor; rows below it are gone wherever a copy of them lies (memory, SSD,
    a snapshot), so their physical deletion may come at any time later. The floor only
    rises: to ``clock - ttl`` with the table's step count (for a ttl in data time: to the
    oldest step as of which the newest event time trained was within ``ttl`` of the newest
    one now), and to the oldest step whose rows, with all newer ones, fit ``max_rows``. For
    that each table keeps the count of live rows per last-lookup step (and, in data time,
    the newest event time as of each step of its window, 8 bytes a step). ``ttl`` needs
    nothing of other ranks but, in data time, the batch's newest event time over all ranks;
    ``max_rows`` on a table sharded row-wise (``partitions[t] = (world, rank)``) needs every
    rank's counts, and its floor is raised by :class:`SharedRowCaps` before the next lookup.

    Example::

        expiry = RowExpiry(["user", "ad"], [Expiry(ttl=1000), None], stamp_column=96)
        live = expiry.live(tables, rows)          # rows read from any tier
        expiry.relooked(tables, before, after)    # a training lookup's rows: rank keys before, after
        expiry.advance(steps, event_time)         # after the step: floors raised
    """

    def __init__(self, names: Sequence[str], settings: Sequence[Expiry | None], stamp_column: int,
                 partitions: Sequence[tuple[int, int]] | None = None) -> None:
        self.names = list(names)
        self.settings = list(settings)
        worlds = [world for world, _ in (partitions or [(1, 0)] * len(self.names))]
        self.column = stamp_column
        n = len(self.names)
        self.stamped = np.array([s is not None for s in self.settings], dtype=bool)
        self.scored = np.array([s is not None and s.scored for s in self.settings], dtype=bool)
        # Per scored table: log2 of the decay's gain a step, and what a show and a click add.
        self.gain = np.array([-np.log2(s.decay) if s is not None else 0.0 for s in self.settings])
        self.clicks_count = np.array([s is not None and s.score == "show_click" for s in self.settings], dtype=bool)
        self.show_weight = np.array([s.nonclick_weight if s is not None and s.score == "show_click" else 1.0
                                     for s in self.settings])
        self.click_weight = np.array([s.click_weight if s is not None and s.score == "show_click" else 1.0
                                      for s in self.settings])
        self.ttl = np.array([s.ttl_steps if s is not None and s.ttl_steps is not None else -1
                             for s in self.settings], dtype=np.int64)
        self.ttl_seconds = np.array([s.ttl_seconds if s is not None and s.ttl_seconds is not None else -1.0
                                     for s in self.settings], dtype=np.float64)
        self.timed = self.ttl_seconds >= 0
        # Data time: the newest event time trained so far, and per timed table the newest
        # event time as of each step from its floor on (times[t][k]: step time_base[t] + k).
        self.newest: float | None = None
        self.times: list[np.ndarray] = [np.zeros(0, dtype=np.float64) for _ in range(n)]
        self.time_base = np.zeros(n, dtype=np.int64)
        self.max_rows = np.array([s.max_rows if s is not None and s.max_rows is not None else -1
                                  for s in self.settings], dtype=np.int64)
        # A row cap on a table sharded row-wise counts every rank's rows: its floor is raised
        # by SharedRowCaps, collectively, not in advance().
        self.shared_cap = (self.max_rows >= 0) & (np.array(worlds) > 1)
        # Tables whose rows go count their live rows per last-lookup step (stamped tables that
        # expire nothing would count without end, and need no count).
        self.counting = (self.ttl >= 0) | self.timed | (self.max_rows >= 0)
        self.floor = np.where(self.scored, _LOWEST, np.where(self.stamped, 0, _NO_FLOOR)).astype(np.int64)
        # Live rows per last-lookup step: counts[t][k] rows last looked up at step base[t] + k.
        self.counts: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(n)]
        self.base = np.zeros(n, dtype=np.int64)
        self.per_table = {name: {"expired": 0, "evicted": 0} for t, name in enumerate(self.names)
                          if self.counting[t]}
        self.needs_recount = False  # rows were loaded: count them before the next step
        # Per timed table, the step rows loaded without expiry were stamped with (-1: none):
        # it takes the first event time trained after the resume (see widen).
        self.widened_at = np.full(n, -1, dtype=np.int64)
        self.widened_cap = np.zeros(n, dtype=bool)  # tables whose widened rows a max_rows must hold

    @property
    def active(self) -> bool:
        return bool(self.stamped.any())

    def keep_all(self) -> None:
        """No row of this group goes here, while its rows still record their last lookup and
        their scores: a k-step local copy, whose rows' fate the owners decide at merges."""
        self.max_rows[:] = -1
        self.shared_cap[:] = False
        self.counting[:] = False
        self.timed[:] = False  # the owners keep data time, from every rank's event times
        self.per_table = {}

    # -- reads ------------------------------------------------------------------------------

    def last_seen(self, rows: torch.Tensor | np.ndarray) -> np.ndarray:
        return read_last_seen(rows, self.column)

    def live(self, tables: np.ndarray, rows: torch.Tensor | np.ndarray) -> np.ndarray:
        """Which of these stored rows (``[n, width]``, of local ``tables``) are still there."""
        if not len(tables):
            return np.ones(0, dtype=bool)
        return self.rank_keys(tables, rows) >= self.floor[tables]

    def rank_keys(self, tables: np.ndarray, rows: torch.Tensor | np.ndarray, column: int | None = None) -> np.ndarray:
        """What a row's floor applies to: its last lookup step, or in a table kept by a score,
        its score's bucket (rows never looked up in training: below every floor). ``rows``
        hold the stamp at ``column`` (default: the group's) and, scored, the key after it."""
        column = self.column if column is None else column
        last = read_last_seen(rows, column)
        if not self.scored.any():
            return last
        scored = np.flatnonzero(self.scored[tables])
        if len(scored):
            words = rows[scored, column + STAMP_WORDS]
            keys = words.cpu().numpy() if isinstance(words, torch.Tensor) else np.asarray(words)
            last[scored] = np.where(last[scored] < 0, _NEVER, score_bucket(keys))
        return last

    def scores(self, tables: np.ndarray, last_seen: np.ndarray, keys: np.ndarray, shows: np.ndarray,
               clicks: np.ndarray | None, step: np.ndarray) -> np.ndarray:
        """The score keys of rows of scored tables after a training lookup at ``step[t]``:
        each adds its ``shows`` (occurrences in the batch) and, for show/click, its
        ``clicks``, to the score it had (``keys``, where live; a row new or back starts at 0)."""
        gain = step[tables] * self.gain[tables]
        if clicks is None:
            clicks = np.zeros(len(tables))
        added = np.where(self.clicks_count[tables],
                         self.show_weight[tables] * (shows - clicks) + self.click_weight[tables] * clicks, shows)
        had = (last_seen >= 0) & (score_bucket(keys) >= self.floor[tables])
        before = np.where(had, keys.astype(np.float64), -np.inf)
        return np.logaddexp2(before, np.log2(np.maximum(added, 1e-30)) + gain).astype(np.float32)

    @property
    def counters(self) -> dict[str, int]:
        """Rows gone so far over this group's tables: by ``ttl`` (expired) and by ``max_rows`` (evicted)."""
        return {"rows_expired": sum(c["expired"] for c in self.per_table.values()),
                "rows_evicted": sum(c["evicted"] for c in self.per_table.values())}

    def live_rows(self) -> dict[str, int]:
        """Per table whose rows go, the rows live now (this process's share)."""
        return {name: self.live_total(t) for t, name in enumerate(self.names) if self.counting[t]}

    # -- a training step -------------------------------------------------------------------

    def relooked(self, tables: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
        """Stored rows (unique) whose rank keys (:meth:`rank_keys`: last lookup step, or score
        bucket) were ``before`` (below the floor: new, or back after expiring) are ``after``
        now, row by row (a training lookup; k-step tables' merges bring each row's newest
        lookup on any rank)."""
        for t in np.unique(tables[self.counting[tables]]):
            mine = tables == t
            old, new = before[mine], after[mine]
            self._add(int(t), old[old >= self.floor[t]], -1)
            self._add(int(t), new[new >= self.floor[t]], +1)

    def _add(self, t: int, keys: np.ndarray, sign: int) -> None:
        """Count rows at rank keys (steps, or score buckets) in or out."""
        if not len(keys):
            return
        lo = int(keys.min())
        if not len(self.counts[t]):
            self.base[t] = lo
        elif lo < self.base[t]:  # a score below every one counted yet (steps only grow)
            self.counts[t] = np.concatenate([np.zeros(int(self.base[t]) - lo, dtype=np.int64), self.counts[t]])
            self.base[t] = lo
        end = int(keys.max()) + 1 - self.base[t]
        if end > len(self.counts[t]):
            grown = np.zeros(max(end, 2 * len(self.counts[t]), 64), dtype=np.int64)
            grown[: len(self.counts[t])] = self.counts[t]
            self.counts[t] = grown
        np.add.at(self.counts[t], keys - self.base[t], sign)

    def advance(self, clock: np.ndarray, event_time: float | None = None,
                stamped: np.ndarray | None = None) -> None:
        """After a training step (``clock``: the tables' step counts now; ``event_time``: the
        newest event time of its batch, over all ranks; ``stamped``: the step its rows were
        stamped with, ``clock - 1`` unless the step was skipped): raise the floors."""
        if self.timed.any():
            self.observe(clock - 1 if stamped is None else stamped, event_time)
        self.raise_floors(clock)

    def raise_floors(self, clock: np.ndarray) -> None:
        """Raise the floors to what the tables' step counts ``clock`` and the event times
        observed so far allow (:meth:`advance` without a step of its own: a k-step merge)."""
        for t in np.flatnonzero(self.counting):
            floor = int(self.floor[t])
            if self.ttl[t] >= 0:
                floor = max(floor, int(clock[t]) - int(self.ttl[t]))
            if self.timed[t]:
                floor = max(floor, self._time_floor(int(t)))
            ttl_floor = floor
            if self.max_rows[t] >= 0 and not self.shared_cap[t]:
                floor = max(floor, self._score_cap_floor(int(t)) if self.scored[t] else
                            self._cap_floor(int(t), floor, int(clock[t])))
            self._raise_floor(int(t), ttl_floor, floor)

    def observe(self, stamped: np.ndarray, event_time: float | None) -> None:
        """Record the newest event time as of the step whose rows were stamped ``stamped``
        (per table; ``event_time``: that step's newest over all ranks)."""
        if event_time is None:
            t = int(np.flatnonzero(self.timed)[0])
            raise ValueError(f"table {self.names[t]!r}: Expiry.ttl {self.settings[t].ttl!r} counts in data time, but "
                             f"this training batch carries no event time; give the DataModule an event_time_column, "
                             f"or partition_time=True for dt=/hour= partitions (your own loop: "
                             f"observe_event_time before each training forward), or set the ttl in steps")
        self.newest = float(event_time) if self.newest is None else max(self.newest, float(event_time))
        for t in np.flatnonzero(self.timed & (self.widened_at >= 0)):
            # Unless the checkpoint held event times (rows widened from an older member of a
            # snapshot chain: their step's time is there, or they lie below the floor).
            if np.isnan(self.times[t]).all():
                before = max(0, int(stamped[t]) - int(self.widened_at[t]))  # the steps up to the resume
                self.time_base[t], self.times[t] = self.widened_at[t], np.full(max(64, before + 1), np.nan)
                self.times[t][:before] = self.newest
            self.widened_at[t] = -1
        for t in np.flatnonzero(self.timed):
            at = int(stamped[t]) - int(self.time_base[t])
            if at < 0:
                continue  # a step below the floor: its rows are gone already
            if at >= len(self.times[t]):
                grown = np.full(max(at + 1, 2 * len(self.times[t]), 64), np.nan)
                grown[: len(self.times[t])] = self.times[t]
                self.times[t] = grown
            self.times[t][at] = self.newest

    def _time_floor(self, t: int) -> int:
        """The oldest step whose newest event time is within ``ttl`` of the newest trained."""
        times = self.times[t]
        known = np.flatnonzero(~np.isnan(times))
        within = known[times[known] >= self.newest - self.ttl_seconds[t]]
        return int(self.time_base[t]) + int(within[0]) if len(within) else int(self.floor[t])

    def key_span(self, t: int) -> tuple[int, int]:
        """The lowest and highest rank key a live row of table ``t`` may have here (an empty
        span, lowest above highest, where none is counted)."""
        start = max(int(self.floor[t]) - int(self.base[t]), 0)
        held = np.flatnonzero(self.counts[t][start:])
        if not len(held):
            return 1 << 61, -(1 << 61)
        return int(self.base[t]) + start + int(held[0]), int(self.base[t]) + start + int(held[-1])

    def live_total(self, t: int) -> int:
        """Live rows of table ``t``, this process's."""
        return int(self.counts[t][max(0, self.floor[t] - self.base[t]):].sum())

    def raise_cap_floor(self, t: int, floor: int, clock: int) -> None:
        """A row cap's floor, found over every rank's counts (SharedRowCaps): the rows of
        steps below it are evicted."""
        if not self.scored[t] and floor > clock - 1:
            raise ValueError(f"table {self.names[t]!r}: one training batch touched more rows than Expiry.max_rows "
                             f"({int(self.max_rows[t])}) over all ranks; raise max_rows")
        self._raise_floor(t, int(self.floor[t]), floor)

    def window(self, t: int, start: int, stop: int) -> np.ndarray:
        """Live rows per step of ``[start, stop)``, this process's."""
        out = np.zeros(stop - start, dtype=np.int64)
        counts, base = self.counts[t], int(self.base[t])
        lo, hi = max(start, base), min(stop, base + len(counts))
        if hi > lo:
            out[lo - start : hi - start] = counts[lo - base : hi - base]
        return out

    def _cap_floor(self, t: int, floor: int, clock: int) -> int:
        """The oldest step whose rows, with all newer ones, fit ``max_rows``."""
        window = self.window(t, floor, clock + 1)
        newer = np.cumsum(window[::-1])[::-1]  # rows last looked up at that step or later
        fits = np.flatnonzero(newer <= self.max_rows[t])
        if not len(fits) or (len(window) >= 2 and newer[-2] > self.max_rows[t]):
            raise ValueError(f"table {self.names[t]!r}: one training batch touched {int(window[-2:].sum())} rows, more "
                             f"than Expiry.max_rows ({int(self.max_rows[t])}); raise max_rows")
        return floor + int(fits[0])

    def _score_cap_floor(self, t: int) -> int:
        """The lowest score bucket whose rows, with all higher ones, fit ``max_rows``."""
        counts, base, floor = self.counts[t], int(self.base[t]), int(self.floor[t])
        start = max(floor - base, 0)
        live = counts[start:]
        newer = np.cumsum(live[::-1])[::-1]  # rows in that bucket or higher
        if not len(live) or newer[0] <= self.max_rows[t]:
            return floor
        fits = np.flatnonzero(newer <= self.max_rows[t])
        if not len(fits):
            raise ValueError(f"table {self.names[t]!r}: more rows than Expiry.max_rows ({int(self.max_rows[t])}) share "
                             f"the highest score; raise max_rows")
        return base + start + int(fits[0])

    def _raise_floor(self, t: int, ttl_floor: int, floor: int) -> None:
        old = int(self.floor[t])
        if floor <= old:
            return
        lo = max(old, int(self.base[t]))  # nothing is counted below the base (a score table's first floor is far)
        gone = self.window(t, lo, floor) if floor > lo else np.zeros(0, dtype=np.int64)
        by_ttl = int(gone[: max(0, ttl_floor - lo)].sum())
        name = self.names[t]
        self.per_table[name]["expired"] += by_ttl
        self.per_table[name]["evicted"] += int(gone.sum()) - by_ttl
        self.floor[t] = floor
        drop = min(floor - int(self.base[t]), len(self.counts[t]))
        if drop > 0:
            self.counts[t] = self.counts[t][drop:].copy()
            self.base[t] += drop
        if self.timed[t]:
            drop = min(floor - int(self.time_base[t]), len(self.times[t]))
            if drop > 0:
                self.times[t] = self.times[t][drop:].copy()
                self.time_base[t] += drop

    # -- checkpoints -----------------------------------------------------------------------

    def state(self) -> dict[str, int]:
        """Per stamped table, its floor: with the rows' stamps and step counts, it says which
        stored rows are live (the per-step counts are recounted from the rows at a load)."""
        return {name: int(self.floor[t]) for t, name in enumerate(self.names) if self.stamped[t]}

    def clock_state(self) -> dict[str, Any]:
        """Data time, where a ttl counts in it: ``{"newest": the newest event time trained,
        "tables": {name: {"base": step, "times": the newest event time as of each step from
        the table's floor on (nan: a step not trained here)}}}``; empty where none does."""
        if not self.timed.any():
            return {}
        tables: dict[str, Any] = {}
        for t in np.flatnonzero(self.timed):
            at = max(0, int(self.floor[t]) - int(self.time_base[t]))
            times = self.times[t][at:]
            known = np.flatnonzero(~np.isnan(times))
            times = times[: known[-1] + 1] if len(known) else times[:0]
            tables[self.names[t]] = {"base": int(self.time_base[t]) + at, "times": times.copy()}
        return {"newest": self.newest, "tables": tables}

    def load_clock(self, state: Mapping[str, Any]) -> None:
        tables = state.get("tables") or {}
        for t in np.flatnonzero(self.timed):
            name = self.names[t]
            if name not in tables:
                raise KeyError(f"table {name!r} has a ttl in data time but the checkpoint holds no event times for "
                               f"it (saved with a ttl in steps, or without expiry?)")
            self.time_base[t] = int(tables[name]["base"])
            self.times[t] = np.asarray(tables[name]["times"], dtype=np.float64).copy()
        newest = state.get("newest")
        self.newest = None if newest is None else float(newest)

    def load(self, floors: dict[str, int]) -> None:
        """The floors of a checkpoint, whose rows replaced this collection's. A table it
        holds none for was saved without expiry (expiry turned on for it at this resume): its
        rows were widened as they loaded (:meth:`widen`) and its floor starts at none gone,
        whatever this collection trained before the load."""
        first = np.where(self.scored, _LOWEST, 0)
        for t, name in enumerate(self.names):
            if self.stamped[t]:
                self.floor[t] = int(floors[name]) if name in floors else int(first[t])
        self.needs_recount = True

    def widen(self, tables: np.ndarray, rows: torch.Tensor, steps: np.ndarray, width: int) -> torch.Tensor:
        """Rows of a checkpoint saved before these tables expired rows (``[n, stamp column]``:
        weights and optimizer state alone) as ``[n, width]`` rows stamped as looked up once at
        the last training step before the save (``steps[t] - 1``, the tables' step counts):
        a ttl runs from the resume, a score starts at one lookup. Nothing tells which of
        them were looked up last, so a ``max_rows`` they exceed keeps none of them (refused
        at :meth:`check_widened`). A ttl in data time counts their step as having the first
        event time trained after the resume (unless the checkpoint holds event times)."""
        out = torch.zeros(len(rows), width, dtype=rows.dtype)
        out[:, : self.column] = rows
        last = np.maximum(np.asarray(steps, dtype=np.int64) - 1, 0)
        out[:, self.column : self.column + STAMP_WORDS] = torch.from_numpy(stamp_words(last[tables]))
        scored = self.scored[tables]
        if scored.any():
            n = int(scored.sum())
            keys = self.scores(tables[scored], np.full(n, -1), np.zeros(n), np.ones(n), None, last)
            out[torch.from_numpy(scored), self.column + STAMP_WORDS] = torch.from_numpy(keys)
        # Only these tables' rows: a table of the group saved with expiry keeps its stamps.
        these = np.zeros(len(self.names), dtype=bool)
        these[tables] = True
        self.widened_at = np.where(self.timed & these, last, self.widened_at)
        self.widened_cap |= these & (self.max_rows >= 0)
        return out

    def check_widened(self, t: int, total: int) -> None:
        """Refuse rows :meth:`widen` stamped beyond table ``t``'s ``max_rows`` (``total``: its
        live rows, over every rank where the cap is shared): all of one step, they would all
        go at the first step. Checked once, at the first count after the load."""
        if self.widened_cap[t] and total > self.max_rows[t]:
            raise ValueError(f"table {self.names[t]!r}: the checkpoint was saved without expiry and holds "
                             f"{total} rows, above Expiry.max_rows ({int(self.max_rows[t])}); their last "
                             f"lookups are unknown, so none could be told from another and all would go at the "
                             f"first step. Resume first with a ttl alone (its rows then expire by their next "
                             f"lookups), or raise max_rows")
        self.widened_cap[t] = False

    def recount(self, chunks: Callable[[], Iterable[tuple[np.ndarray, np.ndarray, torch.Tensor]]]) -> None:
        """Count the live rows per last-lookup step anew from every stored row (after a load):
        ``chunks()`` yields ``(tables, ids, rows)``."""
        self.counts = [np.zeros(0, dtype=np.int64) for _ in self.names]
        self.base = np.where(self.stamped & ~self.scored, np.maximum(self.floor, 0), 0).astype(np.int64)
        for tables, _, rows in chunks():
            last = self.rank_keys(tables, rows)
            keep = self.counting[tables] & (last >= self.floor[tables])
            for t in np.unique(tables[keep]):
                self._add(int(t), last[keep & (tables == t)], +1)
        self.needs_recount = False
        for t in np.flatnonzero(self.widened_cap & ~self.shared_cap):  # shared caps: SharedRowCaps.settle
            self.check_widened(int(t), self.live_total(int(t)))


def join_clock_states(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Clock states (:meth:`RowExpiry.clock_state`) of several groups or ranks as one: the
    newest event time over all, each table's entry from whichever part holds it (ranks see
    the same event times, so a row-wise table's entries agree)."""
    newest: float | None = None
    tables: dict[str, Any] = {}
    for part in parts:
        if not part:
            continue
        if part.get("newest") is not None:
            newest = part["newest"] if newest is None else max(newest, part["newest"])
        for name, entry in part["tables"].items():
            tables.setdefault(name, entry)
    return {"newest": newest, "tables": tables} if tables else {}
