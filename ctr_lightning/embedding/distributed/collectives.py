"""Collectives the sharded engines share: rows to every rank, tables gathered, uneven all-to-alls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.engine import TableState
from ctr_lightning.embedding.local_tables import LocalTables


def gather_tables(local: dict[str, TableState], tables: Sequence[EmbeddingBagConfig],
                  process_group: dist.ProcessGroup) -> dict[str, TableState]:
    """Collective: every rank's per-table export, joined per table."""
    shards = gather_objects(local, process_group)
    out: dict[str, TableState] = {}
    for t in tables:
        parts = [s[t.name] for s in shards if t.name in s]
        out[t.name] = {"ids": torch.cat([p["ids"] for p in parts]), "rows": torch.cat([p["rows"] for p in parts]),
                       "steps": max(p["steps"] for p in parts)}
    return out


def gather_sightings(local: dict[str, np.ndarray], process_group: dist.ProcessGroup) -> dict[str, np.ndarray]:
    """Collective: admission's sketches of every rank, joined per table (each rank's holds
    its partitions, zeros elsewhere: their maximum is the whole sketch)."""
    joined: dict[str, np.ndarray] = {}
    for part in gather_objects(local, process_group):
        for name, counts in part.items():
            joined[name] = counts if name not in joined else np.maximum(joined[name], counts)
    return joined


def gather_floors(local: dict[str, int], process_group: dist.ProcessGroup) -> dict[str, int]:
    """Collective: expiry's floors of every rank, per table (row-wise shards share a floor;
    a table-wise table's is on its owner alone)."""
    joined: dict[str, int] = {}
    for part in gather_objects(local, process_group):
        for name, floor in part.items():
            joined[name] = max(floor, joined.get(name, floor))
    return joined


def gather_objects(item: Any, process_group: dist.ProcessGroup) -> list[Any]:
    """Collective: every rank's ``item`` (any picklable object), in rank order."""
    out: list[Any] = [None] * process_group.size()
    dist.all_gather_object(out, item, group=process_group)
    return out


def broadcast_from_rank0(value: Any, process_group: dist.ProcessGroup) -> Any:
    """Collective: the group's rank 0's ``value`` (any picklable object) on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0), group=process_group)
    return box[0]


def owners_rows(shard: LocalTables, tables: Sequence[EmbeddingBagConfig], table: str, mine: torch.Tensor,
                ids: torch.Tensor, process_group: dist.ProcessGroup) -> torch.Tensor:
    """Collective: each rank fills in the rows it owns (``mine``) and the sum reaches all."""
    dim = next(t.embedding_dim for t in tables if t.name == table)
    out = torch.zeros(len(ids), dim)
    if mine.any():
        out[mine] = shard.rows(table, ids[mine])
    dist.all_reduce(out, group=process_group)
    return out


class UnevenAllToAll:
    """``all_to_all_single`` with per-destination sizes, counting the bytes sent to others.

    Example::

        exchange = UnevenAllToAll(process_group)
        received = exchange(keys, counts=[3, 5])   # what each rank sent here, by rank
        exchange.bytes_sent
    """

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        self.process_group = process_group
        self.world = process_group.size()
        self.rank = dist.get_rank(process_group)
        self.bytes_sent = 0

    def __call__(self, tensor: torch.Tensor, counts: Sequence[int],
                 expected: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Send ``counts[r]`` rows of ``tensor`` (elements of a 1-D one) to rank r, in order;
        returns what each rank sent here. With ``expected`` (the rows each rank sends here,
        when the receiver knows), the sizes are not exchanged first: one round trip less."""
        send = torch.tensor(list(counts), dtype=torch.int64)
        if expected is not None:
            recv = torch.tensor(list(expected), dtype=torch.int64)
        else:
            recv = torch.empty(self.world, dtype=torch.int64)
            dist.all_to_all_single(recv, send, group=self.process_group)
        out = torch.empty((int(recv.sum()), *tensor.shape[1:]), dtype=tensor.dtype)
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv.tolist(),
                               input_split_sizes=send.tolist(), group=self.process_group)
        row_bytes = tensor.element_size() * (int(np.prod(tensor.shape[1:])) if tensor.dim() > 1 else 1)
        self.bytes_sent += (int(send.sum()) - int(send[self.rank])) * row_bytes
        return list(torch.split(out, recv.tolist()))
