"""Data-parallel tables: a replica on every rank, looked up locally, kept equal by
all-gathering each step's row gradients."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding.local_tables import LocalTables
from ctr_lightning.embedding.table_setup import TableSetup


class DataParallelTables:
    """Small hot tables held whole by every rank of a process group.

    Forward pools this rank's own batch from its replica: no ids or pooled rows travel.
    Backward turns the pooled gradient into row gradients (one per distinct id of the
    batch), all-gathers them with their ids, and every replica applies the same update:
    the rows' summed gradients over all ranks' batches divided by the world size, as
    torchrec's all-to-all divides the owners' gradients of sharded tables. That is the
    update of one process on the global batch, so the replicas stay equal. A step sends
    ``(world - 1) x distinct ids x (8 + 4 x dim)`` bytes a table: for a table of a few
    thousand rows, less than the ids of the batch.

    The replicas' tiers keep their SSD files in a ``replicas`` subdirectory of the rank's.

    Example::

        replicas = DataParallelTables(tables, setup.for_rank(rank), process_group)
        pooled = replicas.forward(local_kjt, train=True)   # [local batch, sum of dims]
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], setup: TableSetup,
                 process_group: dist.ProcessGroup) -> None:
        self.tables = list(tables)
        self.process_group = process_group
        self.world = process_group.size()
        filtered = sorted(t.name for t in self.tables if t.name in setup.admission)
        if filtered:
            raise ValueError(f"tables {filtered}: admission needs one owner per row (row_wise or table_wise sharding); "
                             f"data_parallel tables are small and hot: admit every id there")
        expiring = sorted(t.name for t in self.tables if t.name in setup.expiry)
        if expiring:
            raise ValueError(f"tables {expiring}: Expiry needs one owner per row (row_wise or table_wise sharding); "
                             f"data_parallel tables are small and hot: keep their rows")
        self.local = LocalTables(self.tables, setup.in_subdirectory("replicas"))
        self.is_weighted = setup.is_weighted
        self.feature_names = self.local.feature_names
        self.bytes_sent = 0
        # Per feature: its table's number, and where its columns start in the pooled output.
        table_of = {f: i for i, t in enumerate(self.tables) for f in t.feature_names}
        self.feature_table = [table_of[f] for f in self.feature_names]
        self.columns = np.concatenate([[0], np.cumsum(self.local.dims)]).tolist()
        self.first_feature = [self.feature_names.index(t.feature_names[0]) for t in self.tables]
        self.mean = [t.pooling == PoolingType.MEAN for t in self.tables]
        self.dims = torch.tensor([t.embedding_dim for t in self.tables], dtype=torch.int64)
        self._anchor = torch.zeros((), requires_grad=True)  # so backward reaches _Replicas
        # NCCL moves CUDA tensors only; gloo CPU ones.
        nccl = dist.get_backend(process_group) == "nccl"
        self._wire = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def forward(self, features: KeyedJaggedTensor, train: bool) -> torch.Tensor:
        """This rank's bags of ``features`` (the replicas' keys, in order), pooled."""
        if not train:
            return self.local.forward(features, train=False)
        return _Replicas.apply(self._anchor, self, features)

    # -- backward ----------------------------------------------------------------------------

    def row_gradients(self, features: KeyedJaggedTensor, grad: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per table ``(distinct ids, summed gradient rows)`` of this rank's batch."""
        batch = features.stride()
        lengths = features.lengths().to(torch.int64).cpu()
        values = features.values().cpu()
        weights = features.weights_or_none()
        grad = grad.cpu()
        per_table: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.tables]
        start = 0
        for f, table in enumerate(self.feature_table):
            bag_lengths = lengths[f * batch : (f + 1) * batch]
            n = int(bag_lengths.sum())
            bags = torch.repeat_interleave(torch.arange(batch), bag_lengths)
            rows = grad[bags, self.columns[f] : self.columns[f + 1]]
            scale = torch.ones(n, dtype=grad.dtype)
            if weights is not None:
                scale = scale * weights[start : start + n].cpu().to(grad.dtype)
            if self.mean[table]:
                scale = scale / bag_lengths[bags].clamp(min=1).to(grad.dtype)
            per_table[table].append((values[start : start + n].to(torch.int64), rows * scale[:, None]))
            start += n
        out = []
        for table, parts in enumerate(per_table):
            ids = torch.cat([p[0] for p in parts])
            rows = torch.cat([p[1] for p in parts])
            distinct, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros((len(distinct), rows.shape[1]), dtype=grad.dtype)
            summed.index_add_(0, inverse, rows)
            out.append((distinct, summed))
        return out

    def exchange(self, gradients: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Collective: every rank's row gradients, per table, concatenated in rank order."""
        counts = torch.tensor([len(ids) for ids, _ in gradients], dtype=torch.int64, device=self._wire)
        all_counts = [torch.empty_like(counts) for _ in range(self.world)]
        dist.all_gather(all_counts, counts, group=self.process_group)
        all_counts = [c.cpu() for c in all_counts]
        ids = torch.cat([i for i, _ in gradients])
        rows = torch.cat([g.reshape(-1) for _, g in gradients])
        dims = self.dims
        sizes = [int(c.sum()) for c in all_counts]
        widths = [int((c * dims).sum()) for c in all_counts]
        # all_gather takes equal sizes: pad to the longest.
        got_ids = self._gather(ids, max(sizes))
        got_rows = self._gather(rows, max(widths))
        self.bytes_sent += (self.world - 1) * (ids.numel() * 8 + rows.numel() * rows.element_size() + counts.numel() * 8)
        out: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in self.tables]
        for r in range(self.world):
            id_at = row_at = 0
            for t, count in enumerate(all_counts[r].tolist()):
                dim = int(dims[t])
                out[t][0].append(got_ids[r][id_at : id_at + count])
                out[t][1].append(got_rows[r][row_at : row_at + count * dim].reshape(count, dim))
                id_at += count
                row_at += count * dim
        return [(torch.cat(i), torch.cat(g)) for i, g in out]

    def _gather(self, tensor: torch.Tensor, longest: int) -> list[torch.Tensor]:
        padded = torch.zeros(longest, dtype=tensor.dtype, device=self._wire)
        padded[: len(tensor)] = tensor.to(self._wire)
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.process_group)
        return [g.cpu() for g in gathered]

    def apply(self, gradients: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Update the replica with row gradients of all ranks: one bag a (rank, id), so the
        fused optimizer sums a row's gradients over the ranks and steps it once."""
        bags = max(1, max(len(ids) for ids, _ in gradients))
        values, lengths = [], []
        grad = torch.zeros((bags, self.columns[-1]))
        for f in range(len(self.feature_names)):
            table = self.feature_table[f]
            ids, rows = gradients[table] if f == self.first_feature[table] else (torch.empty(0, dtype=torch.int64), None)
            n = len(ids)
            values.append(ids)
            lengths.append(torch.cat([torch.ones(n, dtype=torch.int64), torch.zeros(bags - n, dtype=torch.int64)]))
            if rows is not None and n:
                grad[:n, self.columns[f] : self.columns[f + 1]] = rows / self.world
        values_t = torch.cat(values)
        kjt = KeyedJaggedTensor(keys=self.feature_names, values=values_t, lengths=torch.cat(lengths),
                                weights=torch.ones(len(values_t)) if self.is_weighted else None, stride=bags)
        with torch.enable_grad():
            pooled = self.local.forward(kjt, train=True)
            pooled.backward(grad.to(pooled.device))


class _Replicas(torch.autograd.Function):
    """Forward: the replica pools this rank's batch. Backward: row gradients all-gathered
    and applied to every replica alike."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, tables: DataParallelTables,  # type: ignore[override]
                features: KeyedJaggedTensor) -> torch.Tensor:
        ctx.tables, ctx.features = tables, features
        return tables.local.forward(features, train=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        tables: DataParallelTables = ctx.tables
        tables.apply(tables.exchange(tables.row_gradients(ctx.features, grad)))
        return None, None, None
