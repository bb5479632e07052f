"""Sparse k-step sync: ranks train local copies of the rows they touch; every k steps the
owners average the copies' deltas (the paper's pull / push per pass)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding.distributed.collectives import (
    UnevenAllToAll,
    broadcast_from_rank0,
    gather_floors,
    gather_objects,
    gather_sightings,
    gather_tables,
    owners_rows,
)
from ctr_lightning.embedding.distributed.kstep_interval import IntervalRecord
from ctr_lightning.embedding.distributed.shard_snapshots import save_shards
from ctr_lightning.embedding.distributed.shared_row_caps import SharedRowCaps
from ctr_lightning.embedding.engine import TableEngine, TableState
from ctr_lightning.embedding.expiry_config import Expiry
from ctr_lightning.embedding.lifecycle.row_expiry import (
    FRESH_KEY,
    STAMP_WORDS,
    join_clock_states,
    merged_keys,
    read_last_seen,
    stamp_words,
)
from ctr_lightning.embedding.local_tables import LocalTables
from ctr_lightning.embedding.sharding_plan import TableSharding, owned_mask, row_owner
from ctr_lightning.embedding.snapshots.table_snapshot import SnapshotManifest, SnapshotRef
from ctr_lightning.embedding.table_setup import TableSetup
from ctr_lightning.embedding.tiers.key_index import KeyIndex, dedup
from ctr_lightning.merge_schedule import MergeSchedule


class KStepTables(TableEngine):
    """Owner shards plus a per-rank local copy of the rows this rank's batches touch.

    Each step, rows the local copy lacks are pulled from their owners (ids out, rows with
    optimizer state back: one all-to-all of each; the optimizer state travels in
    ``state_dtype``, weights in float32). Forward and backward then run on the
    local copy alone, with the fused optimizer; no pooled embeddings or gradients travel.
    When ``schedule`` says (every ``k`` training steps, after any synchronous warm-up
    steps) each rank pushes the deltas of the rows it changed to their owners, each owner
    adds the mean delta of the ranks that touched a row, and the local copies are emptied, so
    the next steps pull fresh rows. An evaluation forward first merges whatever steps are
    pending (collective, as evaluation forwards are), so every rank evaluates the merged rows.

    With ``k=1`` and the same batch on every rank, this equals one process on that batch.

    Tables with an :class:`Expiry` (a ttl in steps, ``max_rows``): the local copy's rows
    record their last lookup step; at a merge each owner takes a row's newest over the
    ranks (the stamp travels exact, beside the rounded optimizer state) and raises its
    floors to the step count, so the rows kept depend on the merges alone. In a table kept
    by a score (LFU, show/click) the local copy's rows also count this rank's lookups (and
    clicks, from this rank's labels) in a score key of their own, begun empty at the pull;
    the owner adds the ranks' keys to its row's (exact, beside the stamp), so the merged
    score holds every lookup of every rank once, and caps the table on it.

    Example::

        tables = KStepTables(configs, setup, plan, process_group, MergeSchedule(k=16))
        pooled = tables.forward(local_kjt, train=True)
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], setup: TableSetup, plan: Mapping[str, TableSharding],
                 process_group: dist.ProcessGroup, schedule: MergeSchedule,
                 state_dtype: torch.dtype = torch.bfloat16) -> None:
        data_parallel = sorted(name for name, sharding in plan.items() if sharding.kind == "data_parallel")
        if data_parallel:
            raise ValueError(f"tables {data_parallel}: data_parallel sharding needs sparse_sync='step'; under 'k_step' "
                             f"every rank trains a local copy of the rows it touches already")
        self.tables = list(tables)
        self.plan = dict(plan)
        self.process_group = process_group
        self.world = process_group.size()
        self.rank = dist.get_rank(process_group)
        self.schedule = schedule
        self._merge_due = False
        owned = [t for t in tables if plan[t.name].kind == "row_wise" or plan[t.name].owner == self.rank]
        row_wise = [t.name for t in tables if plan[t.name].kind == "row_wise"]
        self.shard = LocalTables(owned, setup.for_rank(self.rank).row_wise_shard(self.world, self.rank, row_wise))
        self.caps = SharedRowCaps(self.shard.groups, process_group)  # max_rows of row-wise tables
        # The local copy holds one interval's working set, in memory. It trains every row it
        # touches; admission is the owners' decision, at the merge, on all ranks' sightings.
        # Expiry too: the copy's rows only record their last lookup step (Expiry()) and,
        # where a score keeps rows, count it; the owners take each row's newest stamp over the
        # ranks at the merge, add up the scores, and raise their floors.
        self.local_copy = LocalTables(tables, dataclasses.replace(
            setup.in_memory(), admission={},
            expiry={name: e if e.scored else Expiry() for name, e in setup.expiry.items()}))
        for group in self.local_copy.groups:
            if group.expiry is not None:
                group.expiry.keep_all()
        self.admits = bool(setup.admission)
        self.timed = list(setup.timed_tables)
        index = {t.name: i for i, t in enumerate(tables)}
        self.copy_globals = [np.array([index[n] for n in g.names], dtype=np.int64) for g in self.local_copy.groups]
        self.shard_globals = [np.array([index[n] for n in g.names], dtype=np.int64) for g in self.shard.groups]
        halve_every = [getattr(setup.admission.get(t.name), "halve_every", None) or 0 for t in tables]
        # This interval's sightings (admission) and event times (a ttl in data time), for the merge.
        self.interval = IntervalRecord(len(self.local_copy.groups), np.array(halve_every, dtype=np.int64))
        self._event_time: float | None = None
        self.is_row_wise = np.array([plan[t.name].kind == "row_wise" for t in tables])
        self.table_owner = np.array([plan[t.name].owner for t in tables], dtype=np.int64)
        n = len(tables)
        self.width = np.zeros(n, dtype=np.int64)
        self.dim = np.array([t.embedding_dim for t in tables], dtype=np.int64)
        # Floats a row's optimizer steps (weights and state); the last-lookup stamp follows.
        self.core = np.array([setup.core_width(t.embedding_dim) for t in tables], dtype=np.int64)
        self.scored = np.array([t.name in setup.scored_tables for t in tables])
        self.state_dtype = state_dtype
        self.copy_group_of = np.zeros(n, dtype=np.int64)
        self.copy_local_of = np.zeros(n, dtype=np.int64)
        for g, (group_, globals_) in enumerate(zip(self.local_copy.groups, self.copy_globals)):
            self.width[globals_] = group_.width
            self.copy_group_of[globals_] = g
            self.copy_local_of[globals_] = np.arange(len(globals_))
        # Float32 words a row takes on the wire (optimizer state packed two to a word in bfloat16).
        self.wire_width = np.array([_wire_width(int(w), int(d), int(c), state_dtype)
                                    for w, d, c in zip(self.width, self.dim, self.core)], dtype=np.int64)
        self.shard_group_of = np.full(n, -1, dtype=np.int64)
        self.shard_local_of = np.full(n, -1, dtype=np.int64)
        for name, (g, local) in self.shard.table_of_name.items():
            self.shard_group_of[index[name]], self.shard_local_of[index[name]] = g, local
        self._bases: list[list[tuple[np.ndarray, np.ndarray, torch.Tensor]]] = [[] for _ in self.local_copy.groups]
        self.merges = 0
        self._exchange = UnevenAllToAll(process_group)

    @property
    def sharding_plan(self) -> dict[str, TableSharding]:
        return self.plan

    def comm_bytes(self) -> int:
        return self._exchange.bytes_sent

    # -- one step --------------------------------------------------------------------------

    def forward(self, features: KeyedJaggedTensor, train: bool) -> torch.Tensor:
        parts = self.local_copy.split(features)
        if train:
            # The merge after a step runs when the next training step starts: its backward is done.
            if self._merge_due:
                self.merge()
            # A synchronous step (warm-up) is merged right after, as k = 1 would be.
            self._merge_due = self.schedule.synchronous() | self.schedule.step()
            self.interval.note_step(self._step_counts(), self._event_time, self.schedule.steps - 1)
            self._event_time = None
            self._pull(parts, count=self.admits)
        else:
            # The rows the merge and the pull keep must stay normal tensors when evaluation
            # runs under inference mode, or the next training step cannot update them.
            with torch.inference_mode(False), torch.no_grad():
                if self._merge_due or self.schedule.pending():
                    # Evaluation sees the one merged table, as it sees the merged dense model
                    # (KStepAdamStrategy merges that when validation starts): a rank's own
                    # unmerged rows would score its share of the rows with a model nobody trains.
                    self.merge()
                self._pull(parts)
        return self.local_copy.forward(features, train, parts)

    def observe_event_time(self, seconds: float | None) -> None:
        # Kept for the merge, which takes each step's newest over the ranks: no collective a step.
        self._event_time = seconds

    def observe_labels(self, labels: Any) -> None:
        # The clicks of a show/click score: this rank's batch is the one its local copy looks up.
        self.local_copy.observe_labels(labels)

    def skip_nonfinite_updates(self, skip: bool) -> None:
        # Only the local copy trains in backward, on this rank's batches: it skips on this
        # rank's gradient.
        self.local_copy.skip_nonfinite_updates(skip)

    def _owner(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        by_hash = row_owner(torch.from_numpy(ids), self.world).numpy()
        return np.where(self.is_row_wise[tables], by_hash, self.table_owner[tables])

    def _pull(self, parts: list[tuple[np.ndarray, np.ndarray, Any, Any]], count: bool = False) -> None:
        """Bring the rows of this batch (``LocalTables.split``) that the local copy lacks from
        their owners; with ``count``, note each row's occurrences (sightings, for admission)."""
        wanted_tables, wanted_ids = [], []
        for g, (group, (tables, ids, _, _)) in enumerate(zip(self.local_copy.groups, parts)):
            first, inverse = group.dedup_ahead(tables, ids)
            t, i = tables[first], ids[first]
            if count:
                self.interval.note_sightings(g, t, i, np.bincount(inverse, minlength=len(first)))
            missing = group.absent(t, i)
            wanted_tables.append(self.copy_globals[g][t[missing]])
            wanted_ids.append(i[missing])
        tables, ids = np.concatenate(wanted_tables), np.concatenate(wanted_ids)
        dest = self._owner(tables, ids)
        order = np.argsort(dest, kind="stable")  # by owner, then by group as listed
        tables, ids, dest = tables[order], ids[order], dest[order]
        counts = np.bincount(dest, minlength=self.world)
        asked = self._exchange(torch.from_numpy(np.stack([tables, ids], axis=1)), counts.tolist())
        answers = [self._owned_rows(a[:, 0].numpy(), a[:, 1].numpy()) for a in asked]
        # Each owner's answer is as long as what was asked of it: no sizes to exchange.
        expected = np.bincount(dest, weights=self.wire_width[tables], minlength=self.world).astype(np.int64)
        received = self._exchange(torch.cat(answers), [a.numel() for a in answers], expected.tolist())
        self._insert(tables, ids, counts, received)

    def _owned_rows(self, tables: np.ndarray, ids: np.ndarray) -> torch.Tensor:
        """Full rows (weights and optimizer state) this owner holds, packed for the wire, in order."""
        out = []
        for start, end in _runs(self.shard_group_of[tables]):
            group = self.shard.groups[int(self.shard_group_of[tables[start]])]
            rows = group.full_rows(self.shard_local_of[tables[start:end]], ids[start:end])
            out.append(self._pack(rows, int(tables[start])).reshape(-1))
        return torch.cat(out) if out else torch.empty(0)

    def _pack(self, rows: torch.Tensor, table: int) -> torch.Tensor:
        return _pack(rows, int(self.dim[table]), int(self.core[table]), self.state_dtype)

    def _unpack(self, flat: torch.Tensor, n: int, table: int) -> torch.Tensor:
        return _unpack(flat.view(n, int(self.wire_width[table])), int(self.dim[table]), int(self.core[table]),
                       int(self.width[table]), self.state_dtype)

    def _insert(self, tables: np.ndarray, ids: np.ndarray, counts: np.ndarray, received: list[torch.Tensor]) -> None:
        starts = np.concatenate([[0], np.cumsum(counts)])
        for r in range(self.world):
            flat, offset = received[r], 0
            t_r, i_r = tables[starts[r] : starts[r + 1]], ids[starts[r] : starts[r + 1]]
            for start, end in _runs(self.copy_group_of[t_r]):
                g = int(self.copy_group_of[t_r[start]])
                group = self.local_copy.groups[g]
                size = (end - start) * int(self.wire_width[t_r[start]])
                rows = self._unpack(flat[offset : offset + size], end - start, int(t_r[start]))
                offset += size
                local = self.copy_local_of[t_r[start:end]]
                fresh = torch.from_numpy(self.scored[t_r[start:end]])
                if fresh.any():  # the copy's score keys count this rank's lookups alone (FRESH_KEY)
                    rows[fresh, int(self.core[t_r[start]]) + STAMP_WORDS] = FRESH_KEY
                group.hold(local, i_r[start:end], rows)
                self._bases[g].append((local, i_r[start:end], rows.clone()))

    # -- every k steps ---------------------------------------------------------------------

    def merge(self) -> None:
        """Collective: push the deltas of changed rows to their owners, who add each row's
        mean delta over the ranks that changed it; then empty the local copies."""
        # First, so that a step without event times is refused on every rank before any row moves.
        times = self.interval.times_over_ranks(self.process_group, self.timed) if self.timed else []
        keys: list[list[np.ndarray]] = [[] for _ in range(self.world)]
        flats: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for g, group in enumerate(self.local_copy.groups):
            changed = group.changed()
            if not len(changed):
                continue
            base_index = KeyIndex()
            base_index.insert(np.concatenate([b[0] for b in self._bases[g]]),
                              np.concatenate([b[1] for b in self._bases[g]]),
                              np.arange(sum(len(b[1]) for b in self._bases[g]), dtype=np.int64))
            base_rows = torch.cat([b[2] for b in self._bases[g]])
            position = torch.from_numpy(base_index.lookup(changed.tables, changed.ids))
            delta = changed.values.cpu() - base_rows[position]
            tables = self.copy_globals[g][changed.tables]
            core = int(self.core[tables[0]])
            if group.expiry is not None:  # stamps (and score keys) travel as they are
                delta[:, core:] = changed.values.cpu()[:, core:]
            dest = self._owner(tables, changed.ids)
            packed = self._pack(delta, int(tables[0]))
            columns = [tables, changed.ids]
            if self.admits:  # the owners admit on every rank's sightings, per segment of the interval
                columns.extend(self.interval.sightings(g, changed.tables, changed.ids).T)
            for r in range(self.world):  # each destination gets one block per group
                mine = dest == r
                if mine.any():
                    keys[r].append(np.stack([c[mine] for c in columns], axis=1))
                    flats[r].append(packed[torch.from_numpy(mine)].reshape(-1))
        columns = 2 + (self.interval.segments if self.admits else 0)
        sent_keys = [np.concatenate(k) if k else np.empty((0, columns), dtype=np.int64) for k in keys]
        sent_flat = [torch.cat(f) if f else torch.empty(0) for f in flats]
        got_keys = self._exchange(torch.from_numpy(np.concatenate(sent_keys)), [len(k) for k in sent_keys])
        expected = [int(self.wire_width[k[:, 0].numpy()].sum()) for k in got_keys]
        got_flat = self._exchange(torch.cat(sent_flat), [f.numel() for f in sent_flat], expected)
        self._apply_deltas(got_keys, got_flat, times)
        for g, group in enumerate(self.local_copy.groups):
            group.forget()
            self._bases[g] = []
        self.interval.clear()
        self._merge_due = False
        self.schedule.note_merge()  # unscheduled merges (evaluation, checkpoints) do not move the schedule
        self.merges += 1

    def _apply_deltas(self, got_keys: list[torch.Tensor], got_flat: list[torch.Tensor],
                      times: list[tuple[np.ndarray, float]]) -> None:
        per_group: dict[int, list[tuple[np.ndarray, np.ndarray, torch.Tensor]]] = {}
        for keys, flat in zip(got_keys, got_flat):
            keys = keys.numpy()
            offset = 0
            for start, end in _runs(self.copy_group_of[keys[:, 0]]):
                size = (end - start) * int(self.wire_width[keys[start, 0]])
                rows = self._unpack(flat[offset : offset + size], end - start, int(keys[start, 0]))
                offset += size
                g = int(self.copy_group_of[keys[start, 0]])
                seen = keys[start:end, 2:] if self.admits else np.zeros((end - start, 1), dtype=np.int64)
                per_group.setdefault(g, []).append((keys[start:end, 0], keys[start:end, 1], rows, seen))
        for parts in per_group.values():
            tables = np.concatenate([p[0] for p in parts])
            ids = np.concatenate([p[1] for p in parts])
            rows = torch.cat([p[2] for p in parts])
            first, inverse = dedup(tables, ids)
            mean = torch.zeros(len(first), rows.shape[1])
            mean.index_add_(0, torch.from_numpy(inverse), rows)
            mean /= torch.from_numpy(np.bincount(inverse, minlength=len(first))).to(mean.dtype)[:, None]
            core = int(self.core[tables[0]])
            newest = None
            if self.width[tables[0]] > core:  # each row's newest lookup on any rank, not a mean
                newest = np.full(len(first), -1, dtype=np.int64)
                np.maximum.at(newest, inverse, read_last_seen(rows, core))
            sightings = np.zeros((len(first), parts[0][3].shape[1]), dtype=np.int64)
            np.add.at(sightings, inverse, np.concatenate([p[3] for p in parts]))
            tables, ids = tables[first], ids[first]
            for sg in np.unique(self.shard_group_of[tables]):
                pick = np.flatnonzero(self.shard_group_of[tables] == sg)
                group = self.shard.groups[int(sg)]
                local = self.shard_local_of[tables[pick]]
                # Rows stored nowhere keep their deltas only where admission takes them now.
                keep = group.admit_merged(local, ids[pick], sightings[pick],
                                          self.interval.segment_steps()[:, self.shard_globals[int(sg)]], self.schedule.steps)
                pick, local = pick[keep], local[keep]
                current = group.full_rows(local, ids[pick])
                merged = current + mean[torch.from_numpy(pick)]
                if newest is not None:
                    merged[:, core : core + STAMP_WORDS] = torch.from_numpy(stamp_words(newest[pick]))
                    _add_scores(merged, current, rows, inverse, pick, self.scored[tables[pick]], core)
                group.put_merged(local, ids[pick], merged, current)
        self._expire_owned(times)

    def _expire_owned(self, times: list[tuple[np.ndarray, float]]) -> None:
        """After a merge: the owners' floors rise with the training steps every rank took
        (and, for a ttl in data time, with ``times``: each step's newest event time over the ranks)."""
        clock = self._step_counts()
        for group, globals_ in zip(self.shard.groups, self.shard_globals):
            group.steps = clock[globals_]  # what their sketches age to when saved
            if group.expiry is not None:
                group.expire_until(clock[globals_], [(stamped[globals_], seconds) for stamped, seconds in times])
        self.caps.settle({t.name: int(clock[i]) for i, t in enumerate(self.tables)})  # collective, as the merge is

    def _step_counts(self) -> np.ndarray:
        """Every table's training step count (the local copies count every step)."""
        out = np.zeros(len(self.tables), dtype=np.int64)
        for group, globals_ in zip(self.local_copy.groups, self.copy_globals):
            out[globals_] = group.steps
        return out

    # -- reads, checkpoints ----------------------------------------------------------------

    def owns(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return owned_mask(self.plan[table], ids, self.world, self.rank)

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Collective: merges first, then every rank gets the owners' rows."""
        self.merge()
        return owners_rows(self.shard, self.tables, table, self.owns(table, ids), ids, self.process_group)

    def counters(self) -> dict[str, int]:
        return self.shard.counters()

    def admission_counts(self) -> dict[str, dict[str, int]]:
        return self.shard.admission_counts()

    def sightings(self) -> dict[str, np.ndarray]:
        self.merge()  # the interval's sightings reach the owners' sketches
        return gather_sightings(self.shard.sightings(), self.process_group)

    def load_sightings(self, state: Mapping[str, np.ndarray]) -> None:
        self.shard.load_sightings(state)

    def expiry_counts(self) -> dict[str, dict[str, int]]:
        return self.shard.expiry_counts()

    def expiry_floors(self) -> dict[str, int]:
        # Floors move at merges alone, with the owners' rows: no merge needed to read them.
        return gather_floors(self.shard.expiry_floors(), self.process_group)

    def load_expiry_floors(self, floors: Mapping[str, int]) -> None:
        self.shard.load_expiry_floors(floors)

    def expiry_clock(self) -> dict[str, Any]:
        self.merge()  # the interval's event times reach the owners
        return join_clock_states(gather_objects(self.shard.expiry_clock(), self.process_group))

    def load_expiry_clock(self, state: Mapping[str, Any]) -> None:
        self.shard.load_expiry_clock(state)

    def storage(self) -> dict[str, int]:
        held = self.shard.storage()
        held["dram_bytes"] += self.local_copy.storage()["dram_bytes"]
        return held

    def export(self) -> dict[str, TableState]:
        """Collective: merges, then every rank gets the rows of all shards, per table."""
        self.merge()
        state = gather_tables(self.shard.export(), self.tables, self.process_group)
        steps = {name: s["steps"] for name, s in self.local_copy.export().items()}
        for name in state:
            state[name]["steps"] = steps[name]
        return state

    def load(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        self.shard.load(state, keep=self.owns)
        self._reset_local_copy({name: int(s["steps"]) for name, s in state.items()})

    def save_snapshot(self, directory: str | os.PathLike, parent: SnapshotRef | None = None) -> SnapshotManifest:
        """Collective: merges, then each rank streams its owner shard to its own files (the
        step counts are the local copies', which count every training step)."""
        self.merge()
        steps = {t.name: int(s) for t, s in zip(self.tables, self._step_counts())}
        return save_shards(self.shard, directory, self.process_group, self.plan, steps=steps, parent=parent)

    def load_snapshot(self, directory: str | os.PathLike) -> SnapshotManifest:
        manifest = self.shard.load_snapshot(directory, keep=self.owns)
        self._reset_local_copy(manifest.steps)
        return manifest

    def from_rank0(self, value: Any) -> Any:
        return broadcast_from_rank0(value, self.process_group)

    def _reset_local_copy(self, steps: Mapping[str, int]) -> None:
        """After a load: no rows in the local copy, no pending deltas, the loaded step counts, and the
        merge schedule where they left it (a resumed run neither repeats its warm-up nor
        shifts its merges)."""
        for group in self.local_copy.groups:
            group.forget()
            group.steps = np.array([int(steps[n]) for n in group.names], dtype=np.int64)
        self._bases = [[] for _ in self.local_copy.groups]
        self.interval.clear()
        self._merge_due = False
        # The schedule counts training forwards, the tables their backward passes: the same
        # number in a run that trains every batch it looks up, and every table steps in
        # every backward (the local copies look each one up), so the largest count is the run's.
        self.schedule.resume(max((int(v) for v in steps.values()), default=0))

    def move_device_tier(self, device: torch.device) -> None:
        self.shard.move_device_tier(device)
        self.local_copy.move_device_tier(device)

    # -- working-set prefetch ----------------------------------------------------------------

    def register_upcoming(self, features: KeyedJaggedTensor, batch: int) -> list:
        raise NotImplementedError(
            "sparse_sync='k_step' pulls each row from its owner when a batch first touches it; "
            "working-set prefetch does not read those pulls ahead yet")

    def release_upcoming(self, batch: int) -> None:
        pass  # nothing was registered

    def stop_prefetch(self) -> None:
        pass


def _add_scores(merged: torch.Tensor, current: torch.Tensor, sent: torch.Tensor, inverse: np.ndarray,
                pick: np.ndarray, scored: np.ndarray, core: int) -> None:
    """Score keys of merged rows (``merged``, the merge's rows ``pick``, where ``scored``):
    the owner's score (``current``'s key, where the row was stored and live) plus each
    rank's score of the interval (``sent``, in rank order, ``inverse``: the merge's row of each)."""
    rows = np.flatnonzero(scored)
    if not len(rows):
        return
    column = core + STAMP_WORDS
    at = np.full(int(inverse.max()) + 1, -1, dtype=np.int64)
    at[pick[rows]] = np.arange(len(rows))
    sent_rows = np.flatnonzero(at[inverse] >= 0)
    owner = current[torch.from_numpy(rows)]
    base = np.where(read_last_seen(owner, core) >= 0, owner[:, column].numpy().astype(np.float64), -np.inf)
    keys = merged_keys(base, sent[torch.from_numpy(sent_rows), column].numpy(), at[inverse[sent_rows]])
    merged[torch.from_numpy(rows), column] = torch.from_numpy(keys)


def _wire_width(width: int, dim: int, core: int, state_dtype: torch.dtype) -> int:
    """Float32 words of one row on the wire: weights, the state (bfloat16: two a word), then
    any last-lookup stamp as it is."""
    return width if state_dtype == torch.float32 else dim + (core - dim + 1) // 2 + (width - core)


def _pack(rows: torch.Tensor, dim: int, core: int, state_dtype: torch.dtype) -> torch.Tensor:
    """``[n, width]`` rows as ``[n, wire width]`` float32 words: weights as they are, the
    optimizer state (columns ``dim:core``) rounded to ``state_dtype``, the stamp exact."""
    if state_dtype == torch.float32:
        return rows
    # A fresh buffer, an even number of columns wide: a slice of one row counts as contiguous
    # with the stride of the whole row, which may be odd, and would not view as float32.
    state = torch.zeros(rows.shape[0], core - dim + (core - dim) % 2, dtype=state_dtype)
    state[:, : core - dim] = rows[:, dim:core]
    return torch.cat([rows[:, :dim], state.view(torch.float32), rows[:, core:]], dim=1)


def _unpack(words: torch.Tensor, dim: int, core: int, width: int, state_dtype: torch.dtype) -> torch.Tensor:
    if state_dtype == torch.float32:
        return words
    packed = (core - dim + 1) // 2
    state = words[:, dim : dim + packed].contiguous().view(state_dtype)[:, : core - dim].float()
    return torch.cat([words[:, :dim], state, words[:, dim + packed :]], dim=1)


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """``(start, end)`` of the runs of equal consecutive values."""
    if not len(values):
        return []
    cuts = np.flatnonzero(np.diff(values)) + 1
    bounds = np.concatenate([[0], cuts, [len(values)]])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
