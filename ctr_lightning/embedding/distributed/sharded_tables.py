"""Tables sharded over the ranks of a process group: ids travel to their owners, pooled
embeddings travel back, through torchrec's all-to-all modules; data-parallel tables keep a
replica on every rank."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll, PooledEmbeddingsAllToAll
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding.counters import sum_counters
from ctr_lightning.embedding.distributed.collectives import (
    broadcast_from_rank0,
    gather_floors,
    gather_objects,
    gather_sightings,
    gather_tables,
    owners_rows,
)
from ctr_lightning.embedding.distributed.data_parallel import DataParallelTables
from ctr_lightning.embedding.distributed.shard_snapshots import save_shards
from ctr_lightning.embedding.distributed.shared_row_caps import SharedRowCaps
from ctr_lightning.embedding.engine import TableEngine, TableState
from ctr_lightning.embedding.lifecycle.row_expiry import join_clock_states
from ctr_lightning.embedding.local_tables import LocalTables
from ctr_lightning.embedding.sharding_plan import TableSharding, owned_mask, row_owner
from ctr_lightning.embedding.snapshots.table_snapshot import SnapshotManifest, SnapshotRef
from ctr_lightning.embedding.table_checks import align_features
from ctr_lightning.embedding.table_setup import TableSetup


class ShardedTables(TableEngine):
    """Each rank's shard of the tables, and the two all-to-alls around its lookup.

    A rank holds the rows it owns of every row-wise table (an id's owner is
    :func:`row_owner`) and the table-wise tables placed on it. One step, in torchrec's
    three phases:

    1. :meth:`input_dist`: ids are bucketed by owner and sent with :class:`KJTAllToAll`;
       every owner gets, for each of its features, the bags of all ranks' batches (only
       the ids it owns); in training, where a score counts clicks (``show_click``), each
       id carries its example's label, so the owner counts the clicks one process would;
    2. :meth:`compute`: the owner pools them with its :class:`LocalTables` (row-wise
       shards pool by sum);
    3. :meth:`output_dist`: :class:`PooledEmbeddingsAllToAll` returns each rank's pooled
       rows; row-wise partial sums are added up (and divided by the bag length for mean
       pooling).

    Backward runs the same way in reverse, to the owner's fused optimizer. torchrec's
    all-to-all divides the returning gradients by the world size, so the update equals
    that of one process training on the global batch, as DDP's averaged dense gradients do.

    Data-parallel tables (small hot ones) are whole on every rank
    (:class:`DataParallelTables`): each rank pools its own bags of them, and in backward the
    ranks all-gather their row gradients, so every replica applies the global batch's update.

    Example::

        plan = plan_sharding(tables, dist.get_world_size(), "row_wise")
        sharded = ShardedTables(tables, setup, plan, process_group)   # setup: a TableSetup
        pooled = sharded.forward(local_kjt, train=True)   # [local batch, sum of dims]
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], setup: TableSetup, plan: Mapping[str, TableSharding],
                 process_group: dist.ProcessGroup) -> None:
        self.tables = list(tables)
        self.plan = dict(plan)
        self.process_group = process_group
        self.world = process_group.size()
        self.rank = dist.get_rank(process_group)
        self.module_name = setup.module_name
        self.timed = bool(setup.timed_tables)  # a ttl in data time: event times are all-reduced
        # An owner counts the clicks of its rows from every rank's batch: in training, each id
        # travels with its example's label (see bucketize).
        self.click_tables = setup.click_tables
        self.labels: np.ndarray | None = None  # this rank's coming training batch's
        self.is_weighted = setup.is_weighted
        self.feature_names = [f for t in tables for f in t.feature_names]
        self.dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        row_wise = [t for t in tables if plan[t.name].kind == "row_wise"]
        on_rank = [[t for t in tables if plan[t.name].kind == "table_wise" and plan[t.name].owner == r]
                   for r in range(self.world)]
        replicated = [t for t in tables if plan[t.name].kind == "data_parallel"]
        self.replicas = DataParallelTables(replicated, setup.for_rank(self.rank), process_group) if replicated else None
        # Row-wise shards pool by sum; a mean is taken once all partial sums are in.
        local_tables = [dataclasses.replace(t, pooling=PoolingType.SUM) for t in row_wise] + on_rank[self.rank]
        self.local = LocalTables(local_tables, setup.for_rank(self.rank).row_wise_shard(
            self.world, self.rank, [t.name for t in row_wise]))
        self.caps = SharedRowCaps(self.local.groups, process_group)  # max_rows of row-wise tables
        index = {f: i for i, f in enumerate(self.feature_names)}
        rw_features = [index[f] for t in row_wise for f in t.feature_names]
        # Keys sent to rank r, in the order r's LocalTables expects them.
        self.send = [rw_features + [index[f] for t in on_rank[r] for f in t.feature_names]
                     for r in range(self.world)]
        self.local_keys = [self.feature_names[i] for i in self.send[self.rank]]
        replica_features = {index[f] for t in replicated for f in t.feature_names}
        self.replica_features = [i for i in range(len(self.feature_names)) if i in replica_features]
        self.sharded_features = [i for i in range(len(self.feature_names)) if i not in replica_features]
        self._sharded_index = torch.tensor(self.sharded_features, dtype=torch.int64)
        self.sharded = bool(self.sharded_features)
        self.send_keys = [f"{self.feature_names[i]}@{r}" for r in range(self.world) for i in self.send[r]]
        # key_of[r, f]: the sent key that carries feature f's ids owned by rank r (-1: none).
        self.key_of = torch.full((self.world, len(self.feature_names)), -1, dtype=torch.int64)
        k = 0
        for r in range(self.world):
            for f in self.send[r]:
                self.key_of[r, f] = k
                k += 1
        self.row_wise_feature = torch.zeros(len(self.feature_names), dtype=torch.bool)
        self.row_wise_feature[rw_features] = True
        self.table_owner = torch.tensor([plan[t.name].owner for t in tables for _ in t.feature_names])
        dims = torch.tensor(self.dims)
        self.rw_dim = int(dims[rw_features].sum())
        dim_sum_per_rank = [int(dims[self.send[r]].sum()) for r in range(self.world)]
        # Columns of [sum of row-wise partials | rank 0's table-wise | rank 1's ...] in config order.
        starts, col = {}, 0
        for f in rw_features:
            starts[f] = col
            col += self.dims[f]
        for r in range(self.world):
            for f in self.send[r][len(rw_features):]:
                starts[f] = col
                col += self.dims[f]
        for f in self.replica_features:  # the replicas' pooled columns come last
            starts[f] = col
            col += self.dims[f]
        self.column_order = torch.tensor(
            [starts[f] + d for f in range(len(self.feature_names)) for d in range(self.dims[f])])
        self.block_starts = [0]
        for d in dim_sum_per_rank:
            self.block_starts.append(self.block_starts[-1] + d)
        self.mean_columns = torch.tensor(
            [f for t in row_wise if t.pooling == PoolingType.MEAN for f in map(index.get, t.feature_names)],
            dtype=torch.int64)
        self.ids_a2a = KJTAllToAll(process_group, [len(s) for s in self.send]) if self.sharded else None
        self.pooled_a2a = PooledEmbeddingsAllToAll(process_group, dim_sum_per_rank) if self.sharded else None
        self.bytes_sent = 0  # by this rank to other ranks, all-to-alls of forward and backward

    @property
    def sharding_plan(self) -> dict[str, TableSharding]:
        return self.plan

    def comm_bytes(self) -> int:
        return self.bytes_sent + (self.replicas.bytes_sent if self.replicas is not None else 0)

    # -- one step --------------------------------------------------------------------------

    def forward(self, features: KeyedJaggedTensor, train: bool) -> torch.Tensor:
        self.caps.settle()  # the last step's row caps, over all ranks, before any lookup
        labels = self._take_labels(features) if train and self.click_tables else None
        features, local_in, strides = self.input_dist(features, labels)
        pooled_local = self.compute(local_in, train) if self.sharded else None
        replicated = (self.replicas.forward(features.permute(self.replica_features), train)
                      if self.replicas is not None else None)
        return self.output_dist(pooled_local, strides, features, train, replicated)

    def input_dist(self, features: KeyedJaggedTensor, labels: np.ndarray | None = None
                   ) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor | None, list[int]]:
        """Ids to their owners: ``(features aligned, the ids this rank owns from all ranks'
        batches, each rank's batch size)``; no ids travel where every table is data-parallel.
        With ``labels`` (this rank's batch's, ``[B]``), each id carries its example's label,
        and the owner notes them for its coming lookup, which counts the clicks."""
        features = align_features(features, self.feature_names, self.tables, self.module_name)
        if not self.sharded:
            return features, None, [features.stride()]
        sent, sent_labels = self.bucketize(features, labels)
        arriving = self.ids_a2a(sent).wait()
        # Batch sizes may differ between ranks (an epoch's last batch), so take each rank's.
        strides = [int(s) for s in arriving._stride_per_rank]
        received = arriving.wait()
        weights, id_labels = received.weights_or_none(), None
        if sent_labels is not None:  # a weighted collection's ids: the labels travel on their own
            id_labels = self.ids_a2a(sent_labels).wait().wait().values()
            self.bytes_sent += self._id_bytes(sent_labels)
        elif labels is not None:  # the labels rode as the ids' weights
            weights, id_labels = None, weights
        local_in = KeyedJaggedTensor(keys=self.local_keys, values=received.values(), lengths=received.lengths(),
                                     weights=weights, stride=sum(strides))
        if id_labels is not None:
            self.local.observe_labels(_example_labels(local_in, id_labels))
        self.bytes_sent += self._id_bytes(sent)
        return features, local_in, strides

    def observe_labels(self, labels: Any) -> None:
        if self.click_tables:
            self.labels = labels

    def _take_labels(self, features: KeyedJaggedTensor) -> np.ndarray:
        """This rank's labels for the training forward of ``features``; they are used once."""
        labels, self.labels = self.labels, None
        if labels is None:
            raise ValueError(f"tables {self.click_tables}: Expiry(score='show_click') counts clicks, but this "
                             f"training batch came without its labels (observe_labels before each training forward "
                             f"on every rank; CTRModule does)")
        if len(labels) != features.stride():
            raise ValueError(f"tables {self.click_tables}: Expiry(score='show_click') counts clicks, but "
                             f"observe_labels got {len(labels)} labels for a batch of {features.stride()} examples")
        return labels

    def skip_nonfinite_updates(self, skip: bool) -> None:
        # A rank's non-finite gradient reaches every owner as NaN (loss_scaling), and the
        # replicas all-gather it: every rank skips alike.
        for engine in self._engines():
            engine.skip_nonfinite_updates(skip)

    def compute(self, local_in: KeyedJaggedTensor, train: bool) -> torch.Tensor:
        """This rank's shard pools the bags it received: ``[sum of batches, its dims]``."""
        return self.local.forward(local_in, train)

    def output_dist(self, pooled_local: torch.Tensor | None, strides: list[int], features: KeyedJaggedTensor,
                    train: bool, replicated: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled rows back to the ranks whose batches they belong to, assembled with the
        replicas' (``replicated``) into ``[local batch, sum of dims]`` in config order."""
        blocks = []
        if pooled_local is not None:
            blocks.append(self.pooled_a2a(pooled_local, batch_size_per_rank=strides).wait())
            self.bytes_sent += self._pooled_bytes(strides, pooled_local, train)
        if replicated is not None:
            blocks.append(replicated)
        return self.assemble(blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1), features)

    def _id_bytes(self, sent: KeyedJaggedTensor) -> int:
        per_key = torch.tensor(sent.length_per_key())
        first = sum(len(self.send[r]) for r in range(self.rank))
        own = slice(first, first + len(self.send[self.rank]))
        values_out = int(per_key.sum() - per_key[own].sum())
        value_bytes = sent.values().element_size() + (0 if sent.weights_or_none() is None else 4)
        lengths_out = (len(self.send_keys) - len(self.local_keys)) * sent.stride()
        return values_out * value_bytes + lengths_out * sent.lengths().element_size()

    def _pooled_bytes(self, strides: list[int], pooled_local: torch.Tensor, train: bool) -> int:
        # Forward: the pooled rows of other ranks' bags; backward: the gradient of ours.
        row_bytes = pooled_local.shape[1] * pooled_local.element_size()
        pooled = (sum(strides) - strides[self.rank]) * row_bytes
        if train:
            own_dim = self.block_starts[self.rank + 1] - self.block_starts[self.rank]
            pooled += strides[self.rank] * (self.block_starts[-1] - own_dim) * pooled_local.element_size()
        return pooled

    # -- working-set prefetch ----------------------------------------------------------------

    def register_upcoming(self, features: KeyedJaggedTensor, batch: int) -> list[Callable[[], None]]:
        """Collective: the ids of upcoming ``batch`` travel to their owners ahead of time,
        and each owner notes them and reads its missing rows from SSD in the background,
        so the batch's own lookup finds them in memory."""
        if not self.sharded:  # replicas are small and hot: not read ahead
            return []
        _, local_in, _ = self.input_dist(features)
        # The batch's forward exchanges its ids again and gets new tensors: no dedup to reuse.
        return self.local.register_upcoming(local_in, batch, reuse_dedup=False)

    def release_upcoming(self, batch: int) -> None:
        self.local.release_upcoming(batch)

    def stop_prefetch(self) -> None:
        for engine in self._engines():
            engine.stop_prefetch()

    def _engines(self) -> list[LocalTables]:
        return [self.local] + ([self.replicas.local] if self.replicas is not None else [])

    def bucketize(self, features: KeyedJaggedTensor, labels: np.ndarray | None = None
                  ) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor | None]:
        """The KJT with each feature's ids split by owner: keys ordered by destination rank.

        With ``labels``, each id's example's label goes along, as float32: as the KJT's
        weights where the collection is unweighted (one more tensor in the same all-to-all,
        as torchrec sends weights), else in a second KJT of the same lengths (returned
        second; None otherwise)."""
        if self.replicas is not None:
            features = features.permute(self.sharded_features)
        batch = features.stride()
        lengths = features.lengths().to(torch.int64)
        values = features.values()
        n_features = len(self.sharded_features)
        segment = torch.repeat_interleave(torch.arange(n_features * batch), lengths)
        feature = self._sharded_index[segment // batch]
        dest = torch.where(self.row_wise_feature[feature], row_owner(values.cpu(), self.world),
                           self.table_owner[feature])
        out_segment = self.key_of[dest, feature] * batch + segment % batch
        order = torch.argsort(out_segment, stable=True)
        out_lengths = torch.bincount(out_segment, minlength=len(self.send_keys) * batch)
        out_lengths = out_lengths.to(torch.int32)
        weights = features.weights_or_none()
        id_labels = None
        if labels is not None:  # float32 as Batch.labels: one process counts them so too (LocalTables)
            examples = (segment % batch)[order]
            id_labels = torch.from_numpy(np.asarray(labels, dtype=np.float32))[examples].to(values.device)
        sent = KeyedJaggedTensor(keys=self.send_keys, values=values[order.to(values.device)], lengths=out_lengths,
                                 weights=id_labels if weights is None else weights[order.to(weights.device)],
                                 stride=batch)
        if weights is None or id_labels is None:
            return sent, None
        return sent, KeyedJaggedTensor(keys=self.send_keys, values=id_labels, lengths=out_lengths, stride=batch)

    def assemble(self, pooled: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        """``[batch, sum of dims]`` in config order from the blocks the owners sent back."""
        blocks = [pooled[:, self.block_starts[r] : self.block_starts[r + 1]] for r in range(self.world)]
        row_wise = sum(b[:, : self.rw_dim] for b in blocks)
        parts = [row_wise] + [b[:, self.rw_dim :] for b in blocks] + [pooled[:, self.block_starts[-1] :]]
        out = torch.cat(parts, dim=1).index_select(1, self.column_order.to(pooled.device))
        if len(self.mean_columns):
            out = self._divide_by_lengths(out, features)
        return out

    def _divide_by_lengths(self, out: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        batch = features.stride()
        lengths = features.lengths().reshape(len(self.feature_names), batch).T.to(out.dtype).clamp(min=1)
        scale = torch.ones(batch, len(self.feature_names), dtype=out.dtype, device=out.device)
        scale[:, self.mean_columns] = 1.0 / lengths[:, self.mean_columns].to(out.device)
        per_column = scale.repeat_interleave(torch.tensor(self.dims, device=out.device), dim=1)
        return out * per_column

    # -- reads, checkpoints ----------------------------------------------------------------

    def owns(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` of ``table`` this rank holds."""
        return owned_mask(self.plan[table], ids, self.world, self.rank)

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Collective: every rank passes the same ids and gets the owners' rows (a
        data-parallel table answers from this rank's replica, with no collective)."""
        if self.plan[table].kind == "data_parallel":
            return self.replicas.local.rows(table, ids)
        self.caps.settle()
        return owners_rows(self.local, self.tables, table, self.owns(table, ids), ids, self.process_group)

    def admission_counts(self) -> dict[str, dict[str, int]]:
        return self.local.admission_counts()

    def sightings(self) -> dict[str, np.ndarray]:
        return gather_sightings(self.local.sightings(), self.process_group)

    def expiry_counts(self) -> dict[str, dict[str, int]]:
        return self.local.expiry_counts()

    def expiry_floors(self) -> dict[str, int]:
        self.caps.settle()
        return gather_floors(self.local.expiry_floors(), self.process_group)

    def load_expiry_floors(self, floors: Mapping[str, int]) -> None:
        self.local.load_expiry_floors(floors)

    def expiry_clock(self) -> dict[str, Any]:
        # Every rank sees the same event times (observe_event_time takes the newest over
        # all): a row-wise table's entries agree, a table-wise table's are on its owner.
        return join_clock_states(gather_objects(self.local.expiry_clock(), self.process_group))

    def load_expiry_clock(self, state: Mapping[str, Any]) -> None:
        self.local.load_expiry_clock(state)

    def observe_event_time(self, seconds: float | None) -> None:
        if not self.timed:
            return
        newest = torch.tensor([-math.inf if seconds is None else float(seconds)], dtype=torch.float64)
        dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=self.process_group)
        self.local.observe_event_time(None if math.isinf(float(newest)) else float(newest))

    def load_sightings(self, state: Mapping[str, np.ndarray]) -> None:
        self.local.load_sightings(state)

    def counters(self) -> dict[str, int]:
        return sum_counters(engine.counters() for engine in self._engines())

    def storage(self) -> dict[str, int]:
        return sum_counters(engine.storage() for engine in self._engines())

    def export(self) -> dict[str, TableState]:
        """Collective: every rank gets the rows of all shards, per table (rank 0's replicas)."""
        self.caps.settle()
        local = self.local.export()
        if self.replicas is not None and self.rank == 0:
            local.update(self.replicas.local.export())
        return gather_tables(local, self.tables, self.process_group)

    def load(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        self.local.load(state, keep=self.owns)
        if self.replicas is not None:
            self.replicas.local.load(state)

    def save_snapshot(self, directory: str | os.PathLike, parent: SnapshotRef | None = None) -> SnapshotManifest:
        """Collective: each rank streams its shard to its own files, rank 0 the replicas too;
        rank 0 writes the manifest."""
        self.caps.settle()
        return save_shards(self.local, directory, self.process_group, self.plan, parent=parent,
                           replicas=self.replicas.local if self.replicas is not None else None)

    def load_snapshot(self, directory: str | os.PathLike) -> SnapshotManifest:
        manifest = self.local.load_snapshot(directory, keep=self.owns)
        if self.replicas is not None:
            self.replicas.local.load_snapshot(directory)
        return manifest

    def from_rank0(self, value: Any) -> Any:
        return broadcast_from_rank0(value, self.process_group)

    def move_device_tier(self, device: torch.device) -> None:
        for engine in self._engines():
            engine.move_device_tier(device)


def _example_labels(local_in: KeyedJaggedTensor, id_labels: torch.Tensor) -> np.ndarray:
    """Per example of an owner's lookup (every rank's batch, in rank order), the label its
    ids came with (each id carries its own example's), as float64 like one process's; an
    example none of whose ids this owner holds reads 0, and no lookup reads it."""
    batch = local_in.stride()
    segment = torch.repeat_interleave(torch.arange(len(local_in.keys()) * batch),
                                      local_in.lengths().cpu().to(torch.int64))
    labels = np.zeros(batch, dtype=np.float64)
    labels[(segment % batch).numpy()] = id_labels.cpu().numpy()
    return labels
