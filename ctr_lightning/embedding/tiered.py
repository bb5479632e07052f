"""TieredEmbeddingBagCollection: pooled embeddings whose rows live in HBM, DRAM and SSD."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ctr_lightning.embedding.optimizers import SparseAdam, SparseOptimizer
from ctr_lightning.embedding.storage_config import StorageConfig
from ctr_lightning.embedding.table_checks import align_features, check_tables
from ctr_lightning.embedding.table_group import TableGroup


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

    Example::

        ebc = TieredEmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t0", embedding_dim=64, num_embeddings=10**9,
                                       feature_names=["f0"])],
            storage=StorageConfig(device_rows=100_000, host_bytes=2 << 30, ssd_dir="/nvme/run1"),
            optimizer=SparseAdam(lr=1e-3))
        kt = ebc(kjt)             # KeyedTensor, as torchrec's EmbeddingBagCollection
        ebc.rows("t0", ids)       # current weights, without side effects
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
        device = torch.device(device or "cpu")
        # Tables that share dim, pooling, SSD directory and id space share tiers and kernel calls.
        keys: dict[tuple, list[int]] = {}
        for i, t in enumerate(tables):
            key = (t.embedding_dim, t.pooling, per_table[t.name].ssd_dir, spaces[t.name])
            keys.setdefault(key, []).append(i)
        self._groups: list[TableGroup] = []
        self._group_tables: list[list[int]] = []
        for g, members in enumerate(keys.values()):
            group_tables = [tables[i] for i in members]
            self._groups.append(TableGroup(
                name=f"group{g}_dim{group_tables[0].embedding_dim}",
                tables=group_tables,
                storage=[per_table[t.name] for t in group_tables],
                bounded_ids=[spaces[t.name] == "bounded" for t in group_tables],
                optimizer=optimizer,
                device=device,
                seed=seed,
                global_index=members,
                kernel=kernel,
            ))
            self._group_tables.append(members)
        self._group_features = [[f for i in members for f in tables[i].feature_names]
                                for members in self._group_tables]
        # Per group, the local table index of each of its features, in KJT order.
        self._group_feature_tables = [
            np.array([local for local, i in enumerate(members) for _ in tables[i].feature_names], dtype=np.int64)
            for members in self._group_tables
        ]
        self._group_order = [f for fs in self._group_features for f in fs]
        # Columns of the groups' outputs, put back into config order (None when already so).
        starts, col = {}, 0
        for f in self._group_order:
            starts[f] = col
            col += self._dims[self._feature_names.index(f)]
        order = [starts[f] + d for f, dim in zip(self._feature_names, self._dims) for d in range(dim)]
        self._column_order = None if order == list(range(col)) else torch.tensor(order)
        self._table_of_name = {t.name: (g, local) for g, members in enumerate(self._group_tables)
                               for local, t in enumerate(tables[i] for i in members)}

    # -- torchrec's interface ----------------------------------------------------------------

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._tables

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        features = align_features(features, self._group_order, self._tables, type(self).__name__)
        batch = features.stride()
        lengths = features.length_per_key()
        values = features.values()
        weights = features.weights_or_none() if self._is_weighted else None
        offsets = features.offsets()
        train = self.training and torch.is_grad_enabled()
        outputs: list[torch.Tensor] = []
        key_start = value_start = 0
        for group, names, feature_tables in zip(self._groups, self._group_features, self._group_feature_tables):
            n_keys = len(names)
            n_values = sum(lengths[key_start : key_start + n_keys])
            group_offsets = offsets[key_start * batch : (key_start + n_keys) * batch + 1] - value_start
            ids = values[value_start : value_start + n_values].cpu().numpy().astype(np.int64, copy=False)
            tables = np.repeat(feature_tables, lengths[key_start : key_start + n_keys])
            group_weights = None if weights is None else weights[value_start : value_start + n_values]
            outputs.append(group.lookup(ids, tables, group_offsets, group_weights, batch, train))
            key_start += n_keys
            value_start += n_values
        pooled = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self._column_order is not None:  # groups interleave the config's feature order
            pooled = pooled.index_select(1, self._column_order.to(pooled.device))
        return KeyedTensor(keys=self._feature_names, length_per_key=self._dims, values=pooled)

    def _apply(self, fn: Any, recurse: bool = True) -> TieredEmbeddingBagCollection:
        # .to(device) / .cuda() (Lightning calls them) move the device tier with the module.
        super()._apply(fn, recurse)
        device = fn(torch.empty(0)).device
        for group in self._groups:
            group.move_device_tier(device)
        return self

    # -- inspection ----------------------------------------------------------------------

    def rows(self, table: str, ids: torch.Tensor | np.ndarray | Sequence[int]) -> torch.Tensor:
        """Current weights ``[len(ids), dim]`` of rows of ``table``; reads only, stores nothing."""
        if table not in self._table_of_name:
            raise KeyError(f"no table {table!r}; tables are {[t.name for t in self._tables]}")
        g, local = self._table_of_name[table]
        ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64)
        return self._groups[g].rows(local, ids)

    def tier_stats(self) -> dict[str, int]:
        """Cumulative counts of rows served by each tier, and of rows first created."""
        total: dict[str, int] = {}
        for group in self._groups:
            for k, v in group.stats.items():
                total[k] = total.get(k, 0) + v
        return total

    # -- checkpoints ---------------------------------------------------------------------

    def get_extra_state(self) -> dict[str, Any]:
        return {group.name: group.export() for group in self._groups}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        for group in self._groups:
            if group.name not in state:
                raise KeyError(f"checkpoint has no rows for {group.name} (tables {group.names})")
            group.load(state[group.name])


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
