"""The tables one process holds: table groups, and the KJT -> pooled tensor step over them."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding.counters import sum_counters
from ctr_lightning.embedding.engine import TableEngine, TableState
from ctr_lightning.embedding.lifecycle.row_expiry import join_clock_states
from ctr_lightning.embedding.snapshots.table_snapshot import SnapshotManifest, SnapshotRef, load_tables, save_tables
from ctr_lightning.embedding.table_checks import align_features
from ctr_lightning.embedding.table_group import TableGroup
from ctr_lightning.embedding.table_setup import TableSetup


class LocalTables(TableEngine):
    """Tables held whole by this process, grouped so tables that share dim, pooling, SSD
    directory and id space share tiers and kernel calls (:class:`TableGroup`).

    This is the engine behind :class:`TieredEmbeddingBagCollection` in one process, and
    behind each rank's shard when the collection is sharded.

    Example::

        local = LocalTables(tables, TableSetup.build(tables))
        pooled = local.forward(kjt, train=True)   # [batch, sum of dims], config feature order
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], setup: TableSetup) -> None:
        self.tables = list(tables)
        self.is_weighted = setup.is_weighted
        self.module_name = setup.module_name
        self.feature_names = [f for t in tables for f in t.feature_names]
        self.dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        group_tables = setup.groups(tables)
        self.groups = [TableGroup(f"group{g}_dim{tables[members[0]].embedding_dim}", [tables[i] for i in members], setup)
                       for g, members in enumerate(group_tables)]
        self.group_features = [[f for i in members for f in tables[i].feature_names] for members in group_tables]
        # Per group, the local table index of each of its features, in KJT order.
        self.group_feature_tables = [
            np.array([local for local, i in enumerate(members) for _ in tables[i].feature_names], dtype=np.int64)
            for members in group_tables
        ]
        self.group_order = [f for fs in self.group_features for f in fs]
        # Columns of the groups' outputs, put back into config order (None when already so).
        starts, col = {}, 0
        for f in self.group_order:
            starts[f] = col
            col += self.dims[self.feature_names.index(f)]
        order = [starts[f] + d for f, dim in zip(self.feature_names, self.dims) for d in range(dim)]
        self.column_order = None if order == list(range(col)) else torch.tensor(order)
        self.table_of_name = {tables[i].name: (g, local) for g, members in enumerate(group_tables)
                              for local, i in enumerate(members)}

    def split(self, features: KeyedJaggedTensor) -> list[tuple[np.ndarray, np.ndarray, torch.Tensor,
                                                                torch.Tensor | None]]:
        """Per group: ``(local table of each id, ids, bag offsets, weights)``."""
        features = align_features(features, self.group_order, self.tables, self.module_name)
        batch = features.stride()
        lengths = features.length_per_key()
        values = features.values()
        weights = features.weights_or_none() if self.is_weighted else None
        offsets = features.offsets()
        out = []
        key_start = value_start = 0
        for names, feature_tables in zip(self.group_features, self.group_feature_tables):
            n_keys = len(names)
            n_values = sum(lengths[key_start : key_start + n_keys])
            group_offsets = offsets[key_start * batch : (key_start + n_keys) * batch + 1] - value_start
            ids = values[value_start : value_start + n_values].cpu().numpy().astype(np.int64, copy=False)
            tables = np.repeat(feature_tables, lengths[key_start : key_start + n_keys])
            group_weights = None if weights is None else weights[value_start : value_start + n_values]
            out.append((tables, ids, group_offsets, group_weights))
            key_start += n_keys
            value_start += n_values
        return out

    def forward(self, features: KeyedJaggedTensor, train: bool, parts: list[tuple] | None = None) -> torch.Tensor:
        """Pooled embeddings ``[batch, sum of dims]`` in config feature order (``parts``:
        :meth:`split` of ``features``, when the caller has it already)."""
        batch = features.stride()
        parts = self.split(features) if parts is None else parts
        outputs = [group.lookup(tables, ids, offsets, weights, batch, train)
                   for group, (tables, ids, offsets, weights) in zip(self.groups, parts)]
        pooled = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self.column_order is not None:  # groups interleave the config's feature order
            pooled = pooled.index_select(1, self.column_order.to(pooled.device))
        return pooled

    def move_device_tier(self, device: torch.device) -> None:
        for group in self.groups:
            group.move_device_tier(device)

    def skip_nonfinite_updates(self, skip: bool) -> None:
        for group in self.groups:
            group.skip_nonfinite = skip

    # -- working-set prefetch --------------------------------------------------------------

    def register_upcoming(self, features: KeyedJaggedTensor, batch: int,
                          reuse_dedup: bool = True) -> list[Callable[[], None]]:
        """Note the rows of upcoming ``batch`` and return the SSD reads that bring in the
        rest (see :meth:`TableGroup.register`). ``reuse_dedup``: the lookup of these very
        ``features`` will reuse the dedup done here (false when it gets other tensors)."""
        reads = []
        for group, (tables, ids, _, _) in zip(self.groups, self.split(features)):
            missing_tables, missing_ids = group.register(tables, ids, batch, reuse_dedup)
            if len(missing_ids):
                reads.append(functools.partial(group.stage, missing_tables, missing_ids, batch))
        return reads

    def release_upcoming(self, batch: int) -> None:
        for group in self.groups:
            group.release(batch)

    def stop_prefetch(self) -> None:
        for group in self.groups:
            group.stop_prefetch()

    def group_of(self, table: str) -> tuple[TableGroup, int]:
        """The group holding ``table`` (a name of :attr:`tables`) and the table's number in it."""
        g, local = self.table_of_name[table]
        return self.groups[g], local

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        group, local = self.group_of(table)
        return group.rows(local, ids.numpy().astype(np.int64, copy=False))

    def counters(self) -> dict[str, int]:
        return sum_counters(group.counters() for group in self.groups)

    def storage(self) -> dict[str, int]:
        return sum_counters(group.storage() for group in self.groups)

    def export(self) -> dict[str, TableState]:
        """Per table name: ``ids``, ``rows`` (``[n, dim + optimizer state]``) and ``steps``."""
        out: dict[str, TableState] = {}
        for group in self.groups:
            state = group.export()
            table = state["table"].numpy()
            for local, name in enumerate(group.names):
                mine = torch.from_numpy(np.flatnonzero(table == local))
                out[name] = {"ids": state["id"][mine], "rows": state["rows"][mine],
                             "steps": int(state["steps"][local])}
        return out

    def admission_counts(self) -> dict[str, dict[str, int]]:
        return {name: counts for group in self.groups if group.admission is not None
                for name, counts in group.admission.table_counts().items()}

    def expiry_counts(self) -> dict[str, dict[str, int]]:
        return {name: counts for group in self.groups if group.expiry is not None
                for name, counts in group.expiry_counts().items()}

    def expiry_floors(self) -> dict[str, int]:
        return {name: floor for group in self.groups if group.expiry is not None
                for name, floor in group.expiry.state().items()}

    def load_expiry_floors(self, floors: Mapping[str, int]) -> None:
        for group in self.groups:
            if group.expiry is not None:
                group.expiry.load(floors)

    def expiry_clock(self) -> dict[str, Any]:
        return join_clock_states(group.expiry.clock_state() for group in self.groups if group.expiry is not None)

    def load_expiry_clock(self, state: Mapping[str, Any]) -> None:
        for group in self.groups:
            if group.expiry is not None and group.expiry.timed.any():
                group.expiry.load_clock(state)

    def observe_labels(self, labels: Any) -> None:
        # Clicks count as float32 labels (Batch.labels' dtype), as sharded tables send them to
        # the owners: one process and the ranks count the same clicks, whatever dtype came.
        labels = np.asarray(labels, dtype=np.float32).astype(np.float64)
        for group in self.groups:
            group.observe_labels(labels)

    def observe_event_time(self, seconds: float | None) -> None:
        if seconds is None:
            return  # a training step with no event time: a ttl in data time says so at the step
        for group in self.groups:
            group.observe_event_time(seconds)

    def sightings(self) -> dict[str, np.ndarray]:
        return {name: counts for group in self.groups if group.admission is not None
                for name, counts in group.admission.state(group.steps).items()}

    def load_sightings(self, state: Mapping[str, np.ndarray]) -> None:
        for group in self.groups:
            if group.admission is not None:
                group.admission.load(state)

    def save_snapshot(self, directory: str | os.PathLike, parent: SnapshotRef | None = None) -> SnapshotManifest:
        return save_tables(self, directory, parent=parent)

    def mark_saved(self) -> None:
        """The stored rows are those of the snapshot just saved or loaded: incremental saves
        start from here."""
        for group in self.groups:
            group.mark_saved()

    def load_snapshot(self, directory: str | os.PathLike,
                      keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> SnapshotManifest:
        """As :meth:`TableEngine.load_snapshot`; ``keep(table, ids)`` selects the rows this
        process holds (a shard), default all."""
        return load_tables(self, directory, keep)

    def load(self, state: Mapping[str, Mapping[str, Any]],
             keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
        """Load :meth:`export`'s per-table state; ``keep(table, ids)`` selects the rows this
        process holds (a shard), default all."""
        missing = [t.name for t in self.tables if t.name not in state]
        if missing:
            raise KeyError(f"checkpoint has no rows for tables {missing}; it has {sorted(state)}")
        for group in self.groups:
            tables, ids, rows = [], [], []
            steps = np.array([int(state[name]["steps"]) for name in group.names], dtype=np.int64)
            for local, name in enumerate(group.names):
                table_state = state[name]
                table_ids, table_rows = table_state["ids"], table_state["rows"]
                if keep is not None:
                    mask = keep(name, table_ids)
                    table_ids, table_rows = table_ids[mask], table_rows[mask]
                table_rows = group.loadable(name, table_rows, steps)
                tables.append(np.full(len(table_ids), local, dtype=np.int64))
                ids.append(table_ids.numpy().astype(np.int64))
                rows.append(table_rows)
            group.load(np.concatenate(tables), np.concatenate(ids), torch.cat(rows), steps)
