"""The traffic model: what a placement of the tables makes one rank's step do (lookups,
distinct rows, tier misses, SSD reads, bytes on each link, collectives), priced by the cost
model's :func:`estimate_step`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ctr_lightning.embedding.kernels.sparse_update import state_width
from ctr_lightning.topology.access_profile import TableAccess
from ctr_lightning.topology.cost_model import HardwareRates, StepEstimate, TableLoad, estimate_step
from ctr_lightning.topology.machine import Machine
from ctr_lightning.topology.model_shape import ModelShape
from ctr_lightning.topology.placement_plan import RankPlacement, TablePlacement

SSD_OVERHEAD = 1.5  # the SSD log's files stay under 1.5x the live rows
SSD_TYPICAL = 1.3  # and hold about 1.3x once cleaning runs


class StepPricing:
    """One rank's step under a placement of the tables: each table's lookups, distinct
    rows and tier misses, the bytes the tables' and the dense part's collectives send inside
    and across nodes, priced by :func:`estimate_step` at ``rates``.

    ``holders`` (per table, the ranks holding a shard or copy of it) says which tables a
    rank works on. The tiers are LRU caches: their misses by Che's approximation, from
    ``access``; answers are kept, as the planner asks the same ones of many placements.

    Example::

        pricing = StepPricing(shape, access, world=8, ranks_per_node=8, accelerator="gpu", rates=rates)
        pricing.price_step(0, placements, holders).seconds
    """

    def __init__(self, shape: ModelShape, access: Mapping[str, TableAccess], world: int, ranks_per_node: int,
                 accelerator: str, rates: HardwareRates) -> None:
        self.shape, self.access, self.world, self.rpn = shape, access, world, ranks_per_node
        self.accelerator, self.rates = accelerator, rates
        # Ranks of one sharding, and shardings tried one after another, ask the same questions.
        self._answers: dict[tuple[str, str, float, int], float] = {}

    def unique(self, table: str, lookups: float, skip: int = 0) -> float:
        """Distinct rows ``lookups`` ids of ``table`` touch (beyond its ``skip`` hottest)."""
        return self._ask("unique", table, lookups, skip)

    def misses(self, table: str, lookups: float, cache_rows: int) -> float:
        """Rows ``lookups`` ids of ``table`` miss in an LRU cache of ``cache_rows`` rows."""
        return self._ask("lru_misses", table, lookups, cache_rows)

    def _ask(self, question: str, table: str, lookups: float, rows: int) -> float:
        key = (question, table, lookups, rows)
        if key not in self._answers:
            self._answers[key] = getattr(self.access[table], question)(lookups, rows)
        return self._answers[key]

    def price_step(self, rank: int, placements: Sequence[TablePlacement],
                   holders: Mapping[str, list[int]]) -> StepEstimate:
        """What ``rank``'s step costs with the tables placed as ``placements``."""
        intra, inter = self.link_bytes(self.sparse_sync_bytes(rank, placements) + self.kstep_table_bytes())
        bags, routed, replica_rows = self.pooling_work(rank, placements, holders)
        return estimate_step(self.rates, self.table_loads(rank, placements, holders),
                             self.shape.dense_flops_per_example * self.shape.batch_size, intra, inter,
                             self.collectives(placements), host_tier=self.accelerator == "gpu", extra_bags=bags,
                             routed=routed, replica_rows=replica_rows)

    def link_bytes(self, table_bytes: float) -> tuple[float, float]:
        """A rank's bytes a step ``(inside its node, to other nodes)``: the tables' ``table_bytes``
        and the dense part's all-reduce, spread over the ranks as they sit (k-step sends the
        dense part across nodes once per k steps)."""
        world = self.world
        dense = self.shape.dense_params * 4 * 2 * (world - 1) / world if world > 1 else 0.0
        remote = (world - self.rpn) / (world - 1) if world > 1 else 0.0
        k = max(self.shape.k, 1)
        return (table_bytes * (1 - remote) + dense * (1 - remote),
                table_bytes * remote + dense * remote / k)

    def collectives(self, placements: Sequence[TablePlacement]) -> int:
        """Collectives a step runs, each paying the link's latency once: sharded tables'
        all-to-alls (ids, lengths, pooled rows, their gradients; one merge under k-step),
        the dense part's all-reduce, the replicas' all-gathers."""
        if self.world == 1:
            return 0
        step = self.shape.sparse_sync == "step"
        replicated = any(p.sharding.kind == "data_parallel" for p in placements)
        sharded = any(p.sharding.kind != "data_parallel" for p in placements)
        collectives = ((4 if step else 1) if sharded else 0) + 1
        if step and replicated:
            collectives += 3  # the replicas' gradients: counts, ids, rows
        return collectives

    def pooling_work(self, rank: int, placements: Sequence[TablePlacement],
                     holders: Mapping[str, list[int]]) -> tuple[float, float, float]:
        """``(extra bags, routed, replica rows)`` of :func:`estimate_step` for tables
        synchronised every step; none otherwise."""
        shape, world, b = self.shape, self.world, self.shape.batch_size
        if world == 1 or shape.sparse_sync != "step":
            return 0.0, 0.0, 0.0
        replicated = {p.name for p in placements if p.sharding.kind == "data_parallel"}
        features = {t.name: len(t.feature_names) for t in shape.tables}
        # Beyond one bag an example and feature of its own batch, a shard pools every
        # rank's examples; a replica pools its own and applies a row gradient a rank's distinct id.
        bags = sum(b * world * features[p.name] for p in placements
                   if rank in holders[p.name] and p.name not in replicated)
        bags -= b * sum(features[p.name] for p in placements if p.name not in replicated)
        replica_rows = sum(world * self.unique(name, b * self.access[name].pooling) for name in replicated)
        routed = b * sum(features[p.name] for p in placements if p.name not in replicated)
        return bags, routed, replica_rows

    def table_loads(self, rank: int, placements: Sequence[TablePlacement],
                    holders: Mapping[str, list[int]]) -> list[TableLoad]:
        """The work of each table ``rank`` holds: ids pooled, distinct rows, device misses, SSD reads."""
        b, world = self.shape.batch_size, self.world
        configs = {t.name: t for t in self.shape.tables}
        loads = []
        for p in placements:
            if rank not in holders[p.name]:
                continue
            acc = self.access[p.name]
            global_lookups = b * world * acc.pooling
            n = world if p.sharding.kind == "row_wise" else 1
            # A replica pools its own batch, then steps one bag a rank's distinct id.
            lookups = (b * acc.pooling + world * self.unique(p.name, b * acc.pooling) if self._replica(p)
                       else global_lookups / n)
            loads.append(TableLoad(
                p.name, lookups, self.unique(p.name, global_lookups) / n,
                self.misses(p.name, global_lookups, p.device_rows * n) / n,
                self.ssd_reads(p, global_lookups, n), p.row_bytes, configs[p.name].embedding_dim,
                p.ssd_rows * p.row_bytes * SSD_TYPICAL))
        return loads

    def ssd_reads(self, placement: TablePlacement, lookups: float, shards: int) -> float:
        """Rows of a table a rank reads from SSD in a step of ``lookups`` ids over its
        ``shards`` shards: those in neither its device nor its host tier (the SSD read's
        price, per row and per byte, is :func:`ssd_read_seconds`)."""
        cached = (placement.device_rows + placement.host_rows) * shards
        return self.misses(placement.name, lookups, cached) / shards

    def sparse_sync_bytes(self, rank: int, placements: Sequence[TablePlacement]) -> float:
        """Bytes ``rank`` sends a step for tables synchronised every step: ids and pooled
        rows of sharded tables (and their gradients), the replicas' row gradients."""
        shape, world, b = self.shape, self.world, self.shape.batch_size
        if world == 1 or shape.sparse_sync != "step":
            return 0.0
        configs = {t.name: t for t in shape.tables}
        sent = 0.0
        for p in placements:
            acc, dim = self.access[p.name], configs[p.name].embedding_dim
            ids = b * acc.pooling * 8
            if p.sharding.kind == "row_wise":
                sent += ids * (world - 1) / world + 2 * (world - 1) * b * dim * 4
            elif self._replica(p):  # each rank's distinct ids and their row gradients, to every rank
                sent += (world - 1) * self.unique(p.name, b * acc.pooling) * (8 + dim * 4)
            elif p.sharding.owner == rank:
                sent += (world - 1) * b * dim * 4
            else:
                sent += ids + b * dim * 4
        return sent

    def kstep_table_bytes(self) -> float:
        """Bytes a rank sends a step, on average, for k-step tables: the rows it touches in
        an interval are pulled and pushed once per k steps, weights in float32 and
        optimizer state in bfloat16."""
        shape, world, b = self.shape, self.world, self.shape.batch_size
        if world == 1 or shape.sparse_sync == "step":
            return 0.0
        k = max(shape.k, 1)
        sent = 0.0
        for t in shape.tables:
            acc = self.access[t.name]
            wire = t.embedding_dim * 4 + state_width(shape.optimizer, t.embedding_dim) * 2
            sent += 2 * self.unique(t.name, b * k * acc.pooling) * wire * (world - 1) / world / k
        return sent

    def _replica(self, placement: TablePlacement) -> bool:
        return placement.sharding.kind == "data_parallel" and self.world > 1


def placed_rates(machine: Machine, local: Sequence[RankPlacement], accelerator: str) -> HardwareRates:
    """Published rates of the first local rank's GPU (or CPUs) and NIC, the NIC's
    bandwidth shared by the ranks it serves."""
    gpu = machine.gpus[local[0].gpu] if accelerator == "gpu" and local[0].gpu is not None else None
    nic = next((n for n in machine.nics if n.name == local[0].nic), None)
    rates = HardwareRates.for_machine(machine, gpu, nic.speed_mbps if nic else None, cpus=len(local[0].cpus))
    users = sum(1 for r in local if r.nic == local[0].nic) or 1
    return rates if users == 1 else dataclasses.replace(rates, inter_node_bw=rates.inter_node_bw / users)
