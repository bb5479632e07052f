"""Tables that share one set of tiers and kernel calls: same dim, pooling, SSD directory and id space."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from ctr_lightning.embedding.lifecycle.admission_gate import AdmissionGate
from ctr_lightning.embedding.lifecycle.row_expiry import (
    SCORE_WORDS,
    STAMP_WORDS,
    RowExpiry,
    read_last_seen,
    score_bucket,
    stamp_words,
)
from ctr_lightning.embedding.kernels.pooling import BagLayout, CpuBackward, pool_cpu, pool_torch, update_cpu, update_torch
from ctr_lightning.embedding.prefetch.working_set import WorkingSet
from ctr_lightning.embedding.table_setup import TableSetup
from ctr_lightning.embedding.tiers.key_index import dedup
from ctr_lightning.embedding.tiers.row_cache import Rows
from ctr_lightning.embedding.tiers.miss_path import Admit
from ctr_lightning.embedding.tiers.tier_stack import TierStack

if TYPE_CHECKING:
    from ctr_lightning.embedding.snapshots.segment_sets import SegmentSet, SegmentSetWriter
    from ctr_lightning.embedding.tiers.ssd.ssd_tier import SsdTier


class TableGroup:
    """One step of a few tables: dedup the batch's ids, bring their rows into the device
    tier (:class:`TierStack`), pool them (:mod:`pooling`), and in backward run the sparse
    optimizer on them. Upcoming batches' rows are read ahead by its :class:`WorkingSet`.

    Tables are numbered locally (0, 1, ...) in the order given.

    Example::

        group = TableGroup("group0_dim64", tables, setup)
        pooled = group.lookup(tables_of_ids, ids, offsets, weights=None, batch=4096, train=True)
    """

    def __init__(self, name: str, tables: list[EmbeddingBagConfig], setup: TableSetup) -> None:
        self.name = name
        self.tables = list(tables)
        self.names = [t.name for t in tables]
        self.dim = tables[0].embedding_dim
        self.mode = "mean" if tables[0].pooling == PoolingType.MEAN else "sum"
        self.optimizer = setup.optimizer
        self.width = setup.row_width(self.dim, self.names)
        self.tiers = TierStack(name, tables, setup)
        self.working_set = WorkingSet()
        self.steps = np.zeros(len(tables), dtype=np.int64)  # optimizer steps per table
        self._setup = setup
        self.use_numba = setup.use_numba(setup.device)
        # Set while a GradScaler scales the gradients (see loss_scaling): a backward whose
        # gradient is not finite is a step the scaler skips, so it updates no row.
        self.skip_nonfinite = False
        gate = AdmissionGate(self.names, [setup.admission.get(n) for n in self.names],
                             [setup.row_partition.get(n, (1, 0)) for n in self.names])
        self.admission: AdmissionGate | None = gate if gate.active else None
        expiry = RowExpiry(self.names, [setup.expiry.get(n) for n in self.names], setup.core_width(self.dim),
                           [setup.row_partition.get(n, (1, 0)) for n in self.names])
        self.expiry: RowExpiry | None = expiry if expiry.active else None
        if self.expiry is not None:
            self.tiers.live = self.expiry.live
            self.tiers.rank_by(self.expiry.rank_keys)
        self.event_time: float | None = None  # the newest of the coming training batch, for a ttl in data time
        self.labels: np.ndarray | None = None  # the coming training batch's, for scores that count clicks

    def observe_event_time(self, seconds: float) -> None:
        """The newest event time of the training batch about to run (over all ranks)."""
        if self.expiry is not None and self.expiry.timed.any():
            self.event_time = float(seconds) if self.event_time is None else max(self.event_time, float(seconds))

    def counters(self) -> dict[str, int]:
        """Cumulative counters of the tiers, the read-ahead and admission."""
        admission = self.admission.counters if self.admission is not None else {}
        expiry = self.expiry.counters if self.expiry is not None else {}
        return {**self.tiers.counters(), **self.working_set.counters, **admission, **expiry}

    def storage(self) -> dict[str, int]:
        """What the tiers hold now (see :meth:`TierStack.storage`)."""
        return self.tiers.storage()

    def move_device_tier(self, device: torch.device) -> None:
        self.tiers.move_device_tier(device)
        self.use_numba = self._setup.use_numba(device)

    # -- one step ----------------------------------------------------------------------------

    def lookup(self, tables: np.ndarray, ids: np.ndarray, offsets: torch.Tensor, weights: torch.Tensor | None,
               batch: int, train: bool) -> torch.Tensor:
        """Pooled ``[batch, features * dim]`` embeddings (bags are feature-major).

        With ``train``, the touched rows are updated by the sparse optimizer in backward.
        """
        first, inverse, slots = self._unique_slots(tables, ids)
        u_tables, u_ids = tables[first], ids[first]
        miss = slots < 0
        self.tiers.count_device_hits(int((~miss).sum()))
        if self.expiry is not None:
            self.recount_if_loaded()
            self._restart_gone(slots, ~miss, u_tables, u_ids, inverse, train)
        if miss.any():
            slots[miss] = self.tiers.fetch(u_tables[miss], u_ids[miss], pinned=slots[(~miss) & (slots >= 0)],
                                           working_set=self.working_set, admit=self._admit(inverse, miss, train))
        device_tier = self.tiers.device_tier
        # Rows admission turned away have slot -1: the kernels read them as zeros, update nothing.
        device_tier.touch(slots if self.admission is None else slots[slots >= 0])
        if self.expiry is not None and train:
            shows, clicks = self._shows_and_clicks(u_tables, inverse, offsets, batch)
            self._stamp(slots, u_tables, shows, clicks)
        layout = BagLayout(slots, inverse, offsets, weights, batch)
        on_grad = _RowUpdate(self, slots, u_tables) if train else None
        if self.use_numba:
            return pool_cpu(device_tier.values, self.dim, self.mode == "mean", layout, on_grad)
        return pool_torch(device_tier.values, self.dim, self.mode, layout, on_grad)

    def _admit(self, inverse: np.ndarray, miss: np.ndarray, train: bool) -> Admit | None:
        """What admission takes of the rows a lookup finds stored nowhere: counted as
        sightings (each occurrence in the batch) in training, none otherwise."""
        if self.admission is None:
            return None
        gate = self.admission

        def admit(positions: np.ndarray, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
            sightings = np.bincount(inverse, minlength=len(miss))[np.flatnonzero(miss)[positions]] if train else None
            return gate.admit(tables, ids, sightings, self.steps)

        return admit

    def _restart_gone(self, slots: np.ndarray, hit: np.ndarray, tables: np.ndarray, ids: np.ndarray,
                      inverse: np.ndarray, train: bool) -> None:
        """Device-tier rows of this lookup that expired read as rows stored nowhere: they start
        from the initializer in place (where admission takes them; slot -1 where it does not)."""
        pos = np.flatnonzero(hit & self.expiry.stamped[tables])
        if not len(pos):
            return
        tier = self.tiers.device_tier
        column = self.expiry.column  # the stamps (and scores) alone, not whole rows, are read on this path
        stamps = tier.values[torch.from_numpy(slots[pos]).to(tier.device), column : column + self._stamp_words]
        gone = pos[self.expiry.rank_keys(tables[pos], stamps, column=0) < self.expiry.floor[tables[pos]]]
        if not len(gone):
            return
        taken = np.ones(len(gone), dtype=bool)
        if self.admission is not None:
            sightings = np.bincount(inverse, minlength=len(slots))[gone] if train else None
            taken = self.admission.admit(tables[gone], ids[gone], sightings, self.steps)
        restart = gone[taken]
        self.tiers.tables.initialize(tier.values, slots[restart], tables[restart], ids[restart])
        slots[gone[~taken]] = -1

    @property
    def _stamp_words(self) -> int:
        """Floats after a row's optimizer state: its last lookup step, and its score key in a
        table kept by a score."""
        return STAMP_WORDS + (SCORE_WORDS if self.expiry.scored.any() else 0)

    def observe_labels(self, labels: np.ndarray) -> None:
        """The labels of the training batch about to run, for scores that count clicks."""
        if self.expiry is not None and self.expiry.clicks_count.any():
            self.labels = labels

    def _shows_and_clicks(self, tables: np.ndarray, inverse: np.ndarray, offsets: torch.Tensor,
                          batch: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Per unique row of a training lookup, its occurrences and, where a score counts
        clicks, the clicks among them (each occurrence's example's label); None where no
        table of the group is kept by a score."""
        if not self.expiry.scored.any():
            return None, None
        shows = np.bincount(inverse, minlength=len(tables)).astype(np.float64)
        if not self.expiry.clicks_count.any():
            return shows, None
        labels, self.labels = self.labels, None
        if labels is None:
            name = self.names[int(np.flatnonzero(self.expiry.clicks_count)[0])]
            raise ValueError(f"table {name!r}: Expiry(score='show_click') counts clicks, but this training batch came "
                             f"without its labels (observe_labels before each training forward; CTRModule does)")
        bags = np.diff(offsets.cpu().numpy())
        examples = np.repeat(np.arange(len(bags)), bags) % batch  # bags are feature-major
        return shows, np.bincount(inverse, weights=labels[examples], minlength=len(tables))

    def _stamp(self, slots: np.ndarray, tables: np.ndarray, shows: np.ndarray | None,
               clicks: np.ndarray | None) -> None:
        """A training lookup's stored rows of stamped tables were looked up at this step (and
        in a table kept by a score, add their shows and clicks to it)."""
        mine = np.flatnonzero((slots >= 0) & self.expiry.stamped[tables])
        if not len(mine):
            return
        tier = self.tiers.device_tier
        at = slots[mine]
        index = torch.from_numpy(at).to(tier.device)
        column, words = self.expiry.column, self._stamp_words
        block = tier.values[index, column : column + words].cpu().numpy()
        tables = tables[mine]
        before = self.expiry.rank_keys(tables, block, column=0)
        steps = self.steps[tables]
        after = steps.copy()
        scored = np.flatnonzero(self.expiry.scored[tables])
        if len(scored):
            keys = self.expiry.scores(tables[scored], read_last_seen(block[scored], 0), block[scored, STAMP_WORDS],
                                      shows[mine[scored]], None if clicks is None else clicks[mine[scored]], self.steps)
            block[scored, STAMP_WORDS] = keys
            after[scored] = score_bucket(keys)
        self.expiry.relooked(tables, before, after)
        block[:, :STAMP_WORDS] = stamp_words(steps)
        tier.values[index, column : column + words] = torch.from_numpy(block).to(tier.device)
        # A stamp is a change: the row goes back to SSD with it, and into the next snapshot.
        tier.dirty[at] = True
        tier.changed[at] = True

    def expiry_counts(self) -> dict[str, dict[str, int]]:
        """Per table whose rows go: rows live now, rows expired and evicted so far."""
        self.recount_if_loaded()
        live = self.expiry.live_rows()
        return {name: {"rows": live[name], **counts} for name, counts in self.expiry.per_table.items()}

    def recount_if_loaded(self) -> None:
        if self.expiry.needs_recount:
            self.expiry.recount(lambda: self.tiers.export_chunks())

    def _unique_slots(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first, inverse, slots)`` of checked ids: the unique (table, id) pairs in order
        of first appearance and their device-tier slots (-1: absent). Reuses the dedup that
        :meth:`register` or :meth:`dedup_ahead` did on these same arrays."""
        remembered = self.working_set.remembered_dedup(tables, ids)
        if remembered is not None:
            first, inverse = remembered
            return first, inverse, self.tiers.device_tier.lookup(tables[first], ids[first])
        self.tiers.check_ids(tables, ids)
        return self.tiers.device_tier.lookup_unique(tables, ids)

    def dedup_ahead(self, tables: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Check and deduplicate ids before their lookup, which then reuses the result."""
        self.tiers.check_ids(tables, ids)
        first, inverse = dedup(tables, ids)
        self.working_set.remember_dedup(tables, ids, first, inverse)
        return first, inverse

    def _update(self, slots: np.ndarray, tables: np.ndarray, grad: torch.Tensor | CpuBackward) -> None:
        finite = not self.skip_nonfinite or _finite(grad)
        stamped = self.steps.copy()  # what this step's lookups stamped (the count before it)
        if finite:
            # Every table in the batch counts a step, as torch.optim.SparseAdam counts per parameter.
            self.steps += 1
        if self.expiry is not None:  # a skipped step's stamps count too, at the same step count
            event_time, self.event_time = self.event_time, None
            self.expiry.advance(self.steps, event_time, stamped)
            self.tiers.expire_below(self.expiry.floor)
        if not finite:
            return  # the rows, their optimizer state and the step counts stay as they were
        storage = self.tiers.device_tier.values  # now: the tier may have grown since forward
        if isinstance(grad, CpuBackward):
            update_cpu(storage, self.dim, self.mode == "mean", self.optimizer, self.steps, tables, grad)
        else:
            update_torch(storage, self.optimizer, self.steps, slots, tables, grad)
        stored = slots if self.admission is None else slots[slots >= 0]
        self.tiers.device_tier.dirty[stored] = True
        self.tiers.device_tier.changed[stored] = True

    # -- working-set prefetch ------------------------------------------------------------------

    def register(self, tables: np.ndarray, ids: np.ndarray, batch: int,
                 reuse_dedup: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Note that upcoming ``batch`` needs these rows: those in memory are spared from
        eviction until it has run. Returns the rows to read ahead: in neither memory tier.
        With ``reuse_dedup`` the lookup of these same arrays reuses the dedup.

        Training thread only; batches are registered in increasing order.
        """
        first, inverse, slots = self._unique_slots(tables, ids)
        if reuse_dedup:
            self.working_set.remember_dedup(tables, ids, first, inverse)
        return self.working_set.register(self.tiers.device_tier, self.tiers.host_tier, tables[first], ids[first],
                                         slots, batch)

    def stage(self, tables: np.ndarray, ids: np.ndarray, batch: int) -> None:
        """Read the SSD copies of these rows into DRAM for ``batch`` (prefetch thread)."""
        if self.tiers.ssd is not None:
            self.tiers.wait_for_write()  # rows evicted just before are found where they went
            self.working_set.stage(self.tiers.ssd, tables, ids, batch)

    def release(self, batch: int) -> None:
        self.working_set.release(batch)

    def stop_prefetch(self) -> None:
        self.working_set.stop()

    # -- rows of a k-step interval (see KStepTables) ------------------------------------------

    def absent(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return self.tiers.interval_rows.absent(tables, ids)

    def hold(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor) -> None:
        self.tiers.interval_rows.hold(tables, ids, rows)

    def changed(self) -> Rows:
        return self.tiers.interval_rows.changed()

    def forget(self) -> None:
        self.tiers.interval_rows.forget()

    # -- reads without side effects, writes, checkpoints ----------------------------------------

    def rows(self, table: int, ids: np.ndarray) -> torch.Tensor:
        return self.full_rows(np.full(len(ids), table, dtype=np.int64), ids)[:, : self.dim]

    def full_rows(self, tables: np.ndarray, ids: np.ndarray) -> torch.Tensor:
        """``[weights | optimizer state]`` of rows, freshest tier first; reads only."""
        return self.tiers.full_rows(tables, ids)

    def admit_merged(self, tables: np.ndarray, ids: np.ndarray, sightings: np.ndarray, segment_steps: np.ndarray,
                     clock: int) -> np.ndarray:
        """Under k-step tables, at a merge: which of these rows (unique) keep their merged
        deltas. Rows stored already do; in tables that admit ids selectively, a row stored
        nowhere does when admission takes it with the interval's ``sightings`` (all ranks',
        ``[n, segments]``, see :meth:`AdmissionGate.admit`), ``clock`` being the draws' step."""
        keep = np.ones(len(ids), dtype=bool)
        if self.admission is None:
            return keep
        filtering = self.admission.filtering[tables]
        if filtering.any():
            pick = np.flatnonzero(filtering)
            unstored = pick[~self.tiers.stored(tables[pick], ids[pick])]
            steps = np.full(len(self.names), clock, dtype=np.int64)
            keep[unstored] = self.admission.admit(tables[unstored], ids[unstored], sightings[unstored], steps,
                                                  segment_steps)
        return keep

    def put_merged(self, tables: np.ndarray, ids: np.ndarray, values: torch.Tensor, current: torch.Tensor) -> None:
        """Under k-step tables, at a merge: :meth:`put_rows` of merged rows whose stamps (where
        their table expires rows) are the newest lookup on any rank, and whose score keys
        (where a score keeps them) hold every rank's lookups; the expiry's counts follow.
        ``current``: the rows as :meth:`full_rows` read them before the merge."""
        if self.expiry is None:
            self.put_rows(tables, ids, values)
            return
        self.recount_if_loaded()
        column = self.expiry.column
        before = read_last_seen(current[:, column : column + STAMP_WORDS], 0)
        after = read_last_seen(values[:, column : column + STAMP_WORDS], 0)
        stamped = self.expiry.stamped[tables]
        after = np.where(stamped, np.maximum(before, after), after)
        values = values.clone()
        values[torch.from_numpy(stamped), column : column + STAMP_WORDS] = torch.from_numpy(
            stamp_words(after[stamped])).to(values.dtype)
        self.put_rows(tables, ids, values)
        # What the floors apply to: the stamps, or in a table kept by a score, its buckets.
        keys_before, keys_after = self.expiry.rank_keys(tables, current), self.expiry.rank_keys(tables, values)
        self.expiry.relooked(tables[stamped], keys_before[stamped], keys_after[stamped])

    def raise_cap_floor(self, table: int, floor: int, clock: int) -> None:
        """A row cap's floor found over every rank's rows (SharedRowCaps), ``clock`` being
        the table's training step count."""
        self.expiry.raise_cap_floor(table, floor, clock)
        self.tiers.expire_below(self.expiry.floor)

    def expire_until(self, clock: np.ndarray, times: Sequence[tuple[np.ndarray, float | None]] = ()) -> None:
        """Under k-step tables, after a merge: the floors rise to the tables' step counts
        ``clock`` (the training steps every rank took) and, for a ttl in data time, with
        ``times``: per training step of the interval, what its lookups stamped (per table)
        and its newest event time over all ranks."""
        if self.expiry is not None:
            self.recount_if_loaded()
            if self.expiry.timed.any():
                for stamped, seconds in times:
                    self.expiry.observe(stamped, seconds)
            self.expiry.raise_floors(clock)
            self.tiers.expire_below(self.expiry.floor)

    def put_rows(self, tables: np.ndarray, ids: np.ndarray, values: torch.Tensor) -> None:
        """Overwrite rows (unique pairs) with ``[weights | optimizer state]`` values."""
        self.tiers.put_rows(tables, ids, values)

    def export(self) -> dict[str, torch.Tensor]:
        """Every stored row (``table``, ``id``, ``rows``) and the tables' ``steps``."""
        tables, ids, rows = self.tiers.export()
        return {"table": torch.from_numpy(tables), "id": torch.from_numpy(ids), "rows": rows,
                "steps": torch.from_numpy(self.steps.copy())}

    def load(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor, steps: np.ndarray) -> None:
        """Replace every stored row by ``rows`` of (``tables``, ``ids``); ``steps`` per table."""
        self.tiers.load(tables, ids, rows)
        self.steps = np.asarray(steps, dtype=np.int64).copy()
        if self.expiry is not None:
            self.expiry.needs_recount = True

    # -- table snapshots (see table_snapshot) ----------------------------------------------------

    @property
    def ssd(self) -> SsdTier | None:
        """The SSD tier, or None: a snapshot on its file system hard-links its sealed segments."""
        return self.tiers.ssd

    @property
    def seed(self) -> int:
        """The initial rows' seed: with it a snapshot's reader recomputes the rows never stored."""
        return int(self.tiers.seed)

    def is_bounded(self, table: int) -> bool:
        """Whether ``table``'s ids are bounded (``0 <= id < num_embeddings``)."""
        return bool(self.tiers.bounded[table])

    def export_chunks(self, chunk_rows: int = 1 << 16, changed_only: bool = False,
                      share: SegmentSetWriter | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
        """``(tables, ids, rows)`` of every stored row once, a chunk at a time; with
        ``changed_only``, those changed since :meth:`mark_saved`; ``share`` takes sealed SSD
        segments by hard link instead (see :meth:`TierStack.export_chunks`)."""
        return self.tiers.export_chunks(chunk_rows, changed_only=changed_only, share=share)

    def mark_saved(self) -> None:
        """The stored rows are in a snapshot now: ``export_chunks(changed_only=True)`` starts here."""
        self.tiers.mark_saved()

    def begin_load(self) -> None:
        """Forget every stored row, before :meth:`load_chunk` and :meth:`adopt_segments` calls."""
        self.tiers.begin_load()
        if self.expiry is not None:
            self.expiry.needs_recount = True

    def loadable(self, name: str, rows: torch.Tensor, steps: np.ndarray) -> torch.Tensor:
        """A checkpoint's rows of table ``name`` as this group stores them: as they are, or,
        saved before its tables expired rows (weights and optimizer state alone), stamped as
        looked up at the last step before the save (:meth:`RowExpiry.widen`; ``steps``: the
        saved step counts of the group's tables)."""
        if rows.shape[1] == self.width:
            return rows
        if self.expiry is None or rows.shape[1] != self.expiry.column:
            raise ValueError(f"table {name!r}: checkpoint rows have width {rows.shape[1]} (weights + optimizer "
                             f"state{', and expiry stamps' if rows.shape[1] > self.width else ''}), this collection "
                             f"stores {self.width} (another optimizer, or expiry settings the rows cannot take?)")
        return self.expiry.widen(np.full(len(rows), self.names.index(name), dtype=np.int64), rows, steps, self.width)

    def load_chunk(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor, older: bool = False) -> None:
        """Store a snapshot's rows; with ``older``, keys loaded already are skipped (they came
        from a newer snapshot of the chain)."""
        self.tiers.load_chunk(tables, ids, rows, older=older)

    def adopt_segments(self, segment_set: SegmentSet,
                       keep: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                       older: bool = False) -> list[int]:
        """Take a snapshot's shared segments into the SSD tier by hard link, the records
        ``keep(tables, ids)`` selects; returns the segments not taken, whose rows the caller
        loads instead."""
        return self.tiers.adopt_segments(segment_set, keep, older)


class _RowUpdate:
    """The update one training forward owes its rows, which its backward runs. Only the
    forward's autograd graph keeps it, so the rows stay pinned until the backward, or until
    the graph is freed without one (a skipped batch, an exception before backward)."""

    def __init__(self, group: TableGroup, slots: np.ndarray, tables: np.ndarray) -> None:
        self.group, self.slots, self.tables = group, slots, tables
        self.release: Callable[[], None] = group.tiers.pin(slots[slots >= 0], holder=self)

    def __call__(self, grad: torch.Tensor | CpuBackward) -> None:
        try:
            self.group._update(self.slots, self.tables, grad)
        finally:
            self.release()


def _finite(grad: torch.Tensor | CpuBackward) -> bool:
    if isinstance(grad, CpuBackward):
        return bool(np.isfinite(grad.grad_out).all())
    return bool(torch.isfinite(grad).all())  # a sync on CUDA: the skip is decided on the host
