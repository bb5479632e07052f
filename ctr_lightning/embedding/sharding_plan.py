"""Which rank owns which rows: row-wise (by a hash of the id), table-wise, or every rank
(data-parallel replicas), per table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.checkpoint_safe import checkpoint_safe

ShardingKind = Literal["row_wise", "table_wise", "data_parallel"]
SHARDING_KINDS = ("row_wise", "table_wise", "data_parallel")
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64


@checkpoint_safe
@dataclass(frozen=True)
class TableSharding:
    """How one table is split over ranks: ``row_wise`` over all ranks, whole on ``owner``
    (``table_wise``), or whole on every rank (``data_parallel``: small hot tables, whose
    lookups then stay local; every replica applies the update of the global batch)."""

    kind: ShardingKind
    owner: int = -1  # the rank holding a table_wise table


def plan_sharding(
    tables: Sequence[EmbeddingBagConfig],
    world_size: int,
    sharding: str | Mapping[str, str] = "row_wise",
) -> dict[str, TableSharding]:
    """Per table name, its :class:`TableSharding`.

    ``sharding`` is ``"row_wise"``, ``"table_wise"``, ``"data_parallel"``, ``"auto"``, or a
    dict table name -> one of those. ``"auto"`` shards row-wise each table larger than an even share of all
    rows (``num_embeddings * embedding_dim`` over ``world_size``), since no single rank
    should hold it; the others go table-wise. Table-wise tables are placed largest first
    on the least loaded rank.

    Example::

        plan = plan_sharding(tables, world_size=4, sharding="auto")
        plan["t0"]   # TableSharding(kind='row_wise', owner=-1)
    """
    names = [t.name for t in tables]
    if isinstance(sharding, Mapping):
        unknown = sorted(set(sharding) - set(names))
        missing = sorted(set(names) - set(sharding))
        if unknown or missing:
            raise ValueError(f"sharding: unknown tables {unknown}, tables without a setting {missing}")
        kinds = dict(sharding)
    else:
        kinds = {n: sharding for n in names}
    sizes = {t.name: t.num_embeddings * t.embedding_dim for t in tables}
    even_share = sum(sizes.values()) / world_size
    for name, kind in kinds.items():
        if kind == "auto":
            kinds[name] = "row_wise" if world_size > 1 and sizes[name] > even_share else "table_wise"
        elif kind not in SHARDING_KINDS:
            raise ValueError(f"table {name!r}: sharding must be one of {list(SHARDING_KINDS)} or 'auto', "
                             f"got {kind!r}")
    load = np.zeros(world_size)
    for name in names:
        if kinds[name] == "row_wise":
            load += sizes[name] / world_size
    plan = {name: TableSharding(kinds[name]) for name in names if kinds[name] in ("row_wise", "data_parallel")}
    for name in sorted((n for n in names if kinds[n] == "table_wise"), key=lambda n: (-sizes[n], n)):
        owner = int(np.argmin(load))
        load[owner] += sizes[name]
        plan[name] = TableSharding("table_wise", owner)
    return {name: plan[name] for name in names}


def row_owner(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank owning each id of a row-wise table: a multiplicative hash, so ids that are
    small integers or already hashed spread evenly."""
    mixed = ids.to(torch.int64) * _GOLDEN  # wraps around, as intended
    return ((mixed >> 32) & 0x7FFFFFFF) % world_size


def owned_mask(sharding: TableSharding, ids: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Which of ``ids`` of a table sharded as ``sharding`` rank ``rank`` holds."""
    if sharding.kind == "row_wise":
        return row_owner(ids, world_size) == rank
    if sharding.kind == "data_parallel":
        return torch.ones(ids.shape, dtype=torch.bool)
    return torch.full(ids.shape, sharding.owner == rank, dtype=torch.bool)
