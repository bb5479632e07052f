"""TieredEmbeddingBagCollection: pooled embeddings whose rows live in HBM, DRAM and SSD."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ctr_lightning.embedding.optimizers import SparseAdam, SparseOptimizer
from ctr_lightning.embedding.local_tables import LocalTables, table_groups
from ctr_lightning.embedding.replicated_tables import ReplicatedTables
from ctr_lightning.embedding.sharded_tables import ShardedTables
from ctr_lightning.embedding.sharding_plan import TableSharding, plan_sharding
from ctr_lightning.embedding.storage_config import StorageConfig
from ctr_lightning.embedding.sparse_update import state_width
from ctr_lightning.embedding.table_checks import check_tables
from ctr_lightning.embedding.table_group import TableGroup
from ctr_lightning.embedding.table_setup import TableSetup


class TieredEmbeddingBagCollection(nn.Module):
    """A drop-in for torchrec's ``EmbeddingBagCollection`` for tables larger than RAM.

    Rows live in up to three tiers (see :class:`StorageConfig`): the device tier the
    compute reads, a DRAM cache, and files on SSD holding every row that left memory.
    Any 64-bit id is its own row (a key index, no hashing into ``num_embeddings``)
    unless the table's ids are declared ``"bounded"``. A row nobody trained is stored
    nowhere: its initial value is a function of (seed, table, id).

    The sparse optimizer runs inside backward on the touched rows only, with its state
    stored beside each row in every tier; give Lightning's optimizer only the other
    parameters (this module has none).

    Args:
        tables: the tables, as torchrec configs (SUM or MEAN pooling).
        storage: one :class:`StorageConfig` for all tables, or one per table name.
            Default: everything in the device tier.
        optimizer: :class:`SparseAdam` (default), ``SparseAdagrad``, ``RowWiseAdagrad``, ``SparseSGD``.
        id_space: ``"hashed"`` (any non-negative id) or ``"bounded"`` (``0 <= id <
            num_embeddings``), for all tables or per table name.
        is_weighted: whether the KJT carries per-id weights.
        device: where the device tier lives (CPU memory or a CUDA device).
        seed: initial values.
        kernel: ``"numba"`` (fused CPU kernels, the default on CPU), ``"torch"`` (generic
            torch ops, the default on CUDA), or ``"auto"``.
        sharding: under torch.distributed with more than one rank, how tables are split:
            ``"row_wise"`` (by a hash of the id), ``"table_wise"``, ``"auto"`` (see
            :func:`plan_sharding`), or a dict table name -> kind. Each rank passes its own
            batch; ids travel to their owners and pooled rows back (torchrec all-to-alls).
            Each rank's SSD files go into ``<ssd_dir>/rank<r>``.
        process_group: the ranks to shard over; default all, in a group of their own.
        sparse_sync: when sharded, ``"step"`` (ids and pooled rows travel every step) or
            ``"k_step"``: each rank trains a local replica of the rows its batches touch
            (pulling rows it lacks from their owners) and every ``sync_every`` training
            steps pushes the deltas to the owners, who average them over the ranks that
            touched each row (see :class:`ReplicatedTables`).

    Example::

        ebc = TieredEmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t0", embedding_dim=64, num_embeddings=10**9,
                                       feature_names=["f0"])],
            storage=StorageConfig(device_rows=100_000, host_bytes=2 << 30, ssd_dir="/nvme/run1"),
            optimizer=SparseAdam(lr=1e-3))
        kt = ebc(kjt)             # KeyedTensor, as torchrec's EmbeddingBagCollection
        ebc.rows("t0", ids)       # current weights, without side effects
        # Under torch.distributed (world size > 1) the same code shards the tables over ranks.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        storage: StorageConfig | Mapping[str, StorageConfig] | None = None,
        optimizer: SparseOptimizer = SparseAdam(),
        id_space: str | Mapping[str, str] = "hashed",
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        seed: int = 0,
        kernel: str = "auto",
        sharding: str | Mapping[str, str] = "row_wise",
        process_group: dist.ProcessGroup | None = None,
        sparse_sync: str = "step",
        sync_every: int = 16,
    ) -> None:
        super().__init__()
        features = check_tables(tables, type(self).__name__)
        names = [t.name for t in tables]
        storage = storage if storage is not None else StorageConfig()
        per_table = _per_table(storage, names, "storage", StorageConfig)
        spaces = _per_table(id_space, names, "id_space", str)
        for name, space in spaces.items():
            if space not in ("hashed", "bounded"):
                raise ValueError(f"table {name!r}: id_space must be 'hashed' or 'bounded', got {space!r}")
        for t in tables:
            if t.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {t.name!r}: pooling {t.pooling.name} is not supported (SUM or MEAN)")
            if is_weighted and t.pooling != PoolingType.SUM:
                raise ValueError(f"table {t.name!r}: weighted bags need SUM pooling, got {t.pooling.name}")
        self._tables = list(tables)
        self._is_weighted = is_weighted
        self._feature_names = features
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self._storage = per_table
        self._id_space = spaces
        self._optimizer = optimizer
        self._seed = seed
        self._kernel = kernel
        self._device = torch.device(device or "cpu")
        if isinstance(sharding, str) and sharding not in ("row_wise", "table_wise", "auto"):
            raise ValueError(f"sharding must be 'row_wise', 'table_wise', 'auto' or a dict, got {sharding!r}")
        self._sharding = sharding
        self._process_group = process_group
        if sparse_sync not in ("step", "k_step"):
            raise ValueError(f"sparse_sync must be 'step' or 'k_step', got {sparse_sync!r}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self._sparse_sync = sparse_sync
        self._sync_every = sync_every
        if kernel not in ("auto", "numba", "torch"):
            raise ValueError(f"kernel must be 'auto', 'numba' or 'torch', got {kernel!r}")
        if kernel == "numba" and torch.device(device or "cpu").type != "cpu":
            raise ValueError("kernel='numba' needs the device tier in CPU memory")
        for members in table_groups(tables, per_table, spaces):
            group = [tables[i] for i in members]
            width = group[0].embedding_dim + state_width(optimizer, group[0].embedding_dim)
            TableGroup.check_storage([t.name for t in group], [per_table[t.name] for t in group], width * 4)
            if per_table[group[0].name].ssd_dir is not None:
                _check_directory(per_table[group[0].name].ssd_dir, [t.name for t in group])
        # Built on first use: only then is it known whether torch.distributed runs, and
        # the collection shards itself over the ranks (Lightning starts them after the
        # model is made).
        self._engine: LocalTables | ShardedTables | ReplicatedTables | None = None

    def _built(self) -> LocalTables | ShardedTables | ReplicatedTables:
        if self._engine is not None:
            return self._engine
        group = self._process_group
        if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Its own group, so the all-to-alls never interleave with DDP's all-reduces.
            group = dist.new_group()
        setup = TableSetup(self._storage, self._id_space, self._is_weighted, self._optimizer, self._device,
                           self._seed, self._kernel, owner=type(self).__name__)
        if group is not None and group.size() > 1:
            plan = plan_sharding(self._tables, group.size(), self._sharding)
            if self._sparse_sync == "k_step":
                self._engine = ReplicatedTables(self._tables, setup, plan, group, sync_every=self._sync_every)
            else:
                self._engine = ShardedTables(self._tables, setup, plan, group)
        else:
            self._engine = LocalTables(self._tables, setup)
        return self._engine

    @property
    def sharding_plan(self) -> dict[str, TableSharding] | None:
        """Per table, how it is split over ranks; None when the collection is not sharded."""
        engine = self._built()
        return engine.plan if isinstance(engine, (ShardedTables, ReplicatedTables)) else None

    # -- torchrec's interface ----------------------------------------------------------------

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._tables

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        device = features.values().device
        if self._device.type == "cpu" and device.type != "cpu":
            # Else the CPU kernels fail deep inside on a tensor they cannot read.
            raise ValueError(f"{type(self).__name__}: tables {[t.name for t in self._tables]} are in cpu memory but "
                             f"the KJT is on {device}; move the module first (.to({str(device)!r}), as Lightning does)")
        train = self.training and torch.is_grad_enabled()
        pooled = self._built().forward(features, train)
        return KeyedTensor(keys=self._feature_names, length_per_key=self._dims, values=pooled)

    def _apply(self, fn: Any, recurse: bool = True) -> TieredEmbeddingBagCollection:
        # .to(device) / .cuda() (Lightning calls them) move the device tier with the module.
        super()._apply(fn, recurse)
        # Probed on the current device: a dtype-only conversion (.float(), .to(torch.bfloat16))
        # must leave the tier where it is.
        device = fn(torch.empty(0, device=self._device)).device
        if device != self._device:
            if self._kernel == "numba" and device.type != "cpu":
                raise ValueError("kernel='numba' needs the device tier in CPU memory")
            self._device = device
            if self._engine is not None:
                self._engine.move_device_tier(device)
        return self

    # -- inspection ----------------------------------------------------------------------

    def rows(self, table: str, ids: torch.Tensor | np.ndarray | Sequence[int]) -> torch.Tensor:
        """Current weights ``[len(ids), dim]`` of rows of ``table``; reads only, stores nothing.

        When sharded, this is collective: every rank passes the same ids.
        """
        if table not in self._storage:
            raise KeyError(f"no table {table!r}; tables are {[t.name for t in self._tables]}")
        ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64)
        engine = self._built()
        if isinstance(engine, (ShardedTables, ReplicatedTables)):
            return engine.rows(table, torch.from_numpy(ids))
        return engine.rows(table, ids)

    def tier_stats(self) -> dict[str, int]:
        """Cumulative counts (this rank): rows served by each tier, rows first created, rows
        served from what the prefetcher read ahead, rows and bytes it read, and the
        microseconds training waited on SSD reads (``ssd_stall_us``)."""
        return self._built().tier_stats()

    def comm_bytes(self) -> int:
        """Bytes this rank has sent to other ranks in the sharded all-to-alls (0 unsharded)."""
        engine = self._built()
        return engine.bytes_sent if isinstance(engine, (ShardedTables, ReplicatedTables)) else 0

    # -- working-set prefetch (driven by WorkingSetPrefetcher) -----------------------------

    def register_upcoming(self, features: KeyedJaggedTensor, batch: int) -> list[Callable[[], None]]:
        """Note the rows upcoming ``batch`` (numbered in increasing order) will touch, and
        return the reads that bring in those on SSD: callables for a background thread.

        When sharded this is collective (the ids travel to their owners, who note and
        read their rows), so every rank registers its batches in the same order.
        """
        return self._built().register_upcoming(features, batch)

    def release_upcoming(self, batch: int) -> None:
        """``batch`` has run: forget what was read ahead for it."""
        self._built().release_upcoming(batch)

    def stop_prefetch(self) -> None:
        self._built().stop_prefetch()

    # -- checkpoints ---------------------------------------------------------------------

    def get_extra_state(self) -> dict[str, Any]:
        # Per table, whatever the sharding: a checkpoint loads into any number of ranks.
        # When sharded this is collective (Lightning builds checkpoints on every rank).
        return {"tables": self._built().export()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if "tables" not in state:
            raise KeyError("checkpoint holds no 'tables' state for the TieredEmbeddingBagCollection")
        self._built().load(state["tables"])


def _check_directory(path: str, tables: list[str]) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"SSD tier of tables {tables}: cannot create files in {path}: {e.strerror}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"SSD tier of tables {tables}: cannot create files in {path}: not writable")


def _per_table(value: Any, names: list[str], what: str, kind: type) -> dict[str, Any]:
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        missing = sorted(set(names) - set(value))
        if unknown or missing:
            raise ValueError(f"{what}: unknown tables {unknown}, tables without a setting {missing}")
        return dict(value)
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be a {kind.__name__} or a dict of them, got {value!r}")
    return {n: value for n in names}
