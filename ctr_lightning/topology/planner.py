"""The planner: a search over the tables' shardings and tier splits for the plan whose
slowest rank's step is priced lowest. Ranks are placed on the hardware first
(:mod:`hardware_placement`); each candidate is priced by :class:`StepPricing`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ctr_lightning.embedding.sharding_plan import SHARDING_KINDS, TableSharding, plan_sharding
from ctr_lightning.topology.access_profile import TableAccess
from ctr_lightning.topology.cost_model import HardwareRates, StepEstimate
from ctr_lightning.topology.hardware_placement import accelerator_for, intra_groups, place_local_ranks, ranks_per_node
from ctr_lightning.topology.machine import Machine
from ctr_lightning.topology.model_shape import ModelShape
from ctr_lightning.topology.placement_plan import Plan, PlanError, RankPlacement, TablePlacement
from ctr_lightning.topology.plan_options import PlanOptions
from ctr_lightning.topology.step_pricing import SSD_OVERHEAD, StepPricing, placed_rates


def plan(machine: Machine, shape: ModelShape, access: Mapping[str, TableAccess] | None = None,
         options: PlanOptions = PlanOptions(), rates: HardwareRates | None = None) -> Plan:
    """Place ``shape`` on ``options.num_nodes`` machines like ``machine``.

    Ranks go next to their GPU, and to the NIC and drive nearest it; tables get the
    sharding and the DRAM / HBM split that the cost model prices lowest; ``access``
    (per table, default Zipf 1.05 over its rows) says how skewed each table's lookups are.
    Raises :class:`PlanError`, with the numbers, when the plan cannot fit.

    Example::

        from ctr_lightning.topology import discover, plan
        p = plan(discover(), shape)
        print(p.to_text())
    """
    accelerator = accelerator_for(machine, options.accelerator)
    rpn = ranks_per_node(machine, options, accelerator)
    world = rpn * options.num_nodes
    access = dict(access or {})
    for t in shape.tables:
        access.setdefault(t.name, TableAccess.zipf(t.num_embeddings, 1.05, pooling=1.0))
    requested = _apply_constraints(shape, options, access)
    local = place_local_ranks(machine, options, accelerator, rpn)
    ranks = tuple(RankPlacement(node * rpn + r.local_rank, node, r.local_rank, r.gpu, r.numa_node, r.cpus, r.nic,
                                r.ssd_dir, r.device_bytes, r.host_bytes, r.ssd_bytes)
                  for node in range(options.num_nodes) for r in local)
    groups = intra_groups(machine, local, accelerator)
    pricing = StepPricing(shape, access, world, rpn, accelerator, rates or placed_rates(machine, local, accelerator))
    search = _TableSearch(pricing, ranks, options.skew_aware)
    tables, estimates = search.place(search.choose_sharding(requested))
    notes = list(machine.notes)
    if rates is None:
        notes.append(f"rates: published figures for {pricing.rates.name} (HardwareRates.published)")
    return Plan(options.num_nodes, rpn, accelerator, tables, ranks, groups, estimates,
                shape.batch_size * world, tuple(notes), pricing.rates)


def _apply_constraints(shape: ModelShape, options: PlanOptions,
                       access: dict[str, TableAccess]) -> str | Mapping[str, str]:
    """The sharding request with torchrec ``ParameterConstraints`` folded in (and their
    pooling factors into ``access``)."""
    if not options.constraints:
        return options.sharding
    names = [t.name for t in shape.tables]
    unknown = sorted(set(options.constraints) - set(names))
    if unknown:
        raise PlanError(f"constraints name tables the model does not have: {unknown}")
    requested = dict(options.sharding) if isinstance(options.sharding, Mapping) else {n: options.sharding for n in names}
    for name, c in options.constraints.items():
        if getattr(c, "pooling_factors", None):
            access[name] = dataclasses.replace(access[name], pooling=float(sum(c.pooling_factors) / len(c.pooling_factors)))
        kinds = getattr(c, "sharding_types", None)
        if kinds:
            allowed = [k for k in kinds if k in SHARDING_KINDS]
            if not allowed:
                raise PlanError(f"table {name!r}: sharding types {list(kinds)} are not among those "
                                f"TieredEmbeddingBagCollection offers {list(SHARDING_KINDS)}")
            if requested[name] not in allowed:
                requested[name] = allowed[0] if len(allowed) == 1 else "auto"
    return requested


class _TableSearch:
    """Tables onto the placed ranks: per sharding, the tier split within every rank's
    budgets and each rank's step as ``pricing`` prices it; for ``"auto"``, the sharding
    whose slowest rank is priced lowest."""

    MIN_BATCHES = 2  # batches whose rows a tier holds at once: the step's and the next one's

    def __init__(self, pricing: StepPricing, ranks: Sequence[RankPlacement], skew_aware: bool) -> None:
        self.pricing, self.ranks, self.skew_aware = pricing, ranks, skew_aware
        self.shape, self.access, self.world = pricing.shape, pricing.access, len(ranks)

    def place(self, sharding: Mapping[str, TableSharding]) -> tuple[tuple[TablePlacement, ...], tuple[StepEstimate, ...]]:
        """Each table's tier split under ``sharding``, and every rank's step priced."""
        shape, world = self.shape, self.world
        shards = {t.name: (world if sharding[t.name].kind == "row_wise" else 1) for t in shape.tables}
        holders = {t.name: (list(range(world)) if sharding[t.name].kind in ("row_wise", "data_parallel")
                            else [sharding[t.name].owner]) for t in shape.tables}
        device = self._rows_within([r.device_bytes for r in self.ranks], shards, holders)
        cached = self._rows_within([r.device_bytes + r.host_bytes for r in self.ranks], shards, holders)
        placements = []
        for t in shape.tables:
            n, acc = shards[t.name], self.access[t.name]
            rows = math.ceil(t.num_embeddings / n)
            d = min(device[t.name], rows)
            h = min(max(cached[t.name], d), rows) - d
            placements.append(TablePlacement(
                t.name, sharding[t.name], t.num_embeddings, shape.row_bytes(t), d, h, rows - d - h,
                acc.coverage(d * n), acc.coverage((d + h) * n)))
        self._check_fits(placements, holders)
        estimates = tuple(self.pricing.price_step(rank, placements, holders) for rank in range(world))
        return tuple(placements), estimates

    def _rows_within(self, budgets: Sequence[int], shards: Mapping[str, int],
               holders: Mapping[str, list[int]]) -> dict[str, int]:
        """Rows per shard of each table within every rank's budget: skew-aware, each byte
        to the row that serves the most lookups per byte (one threshold for all tables,
        the lowest that fits every rank), or in proportion to the tables' sizes."""
        tables = self.shape.tables
        sizes = {t.name: math.ceil(t.num_embeddings / shards[t.name]) * self.shape.row_bytes(t) for t in tables}
        # A tier holds at least the rows of the batches in flight (the step's and the
        # prefetcher's), or a step cannot run.
        floor = {t.name: min(math.ceil(self.MIN_BATCHES * self.pricing.unique(
            t.name, self.shape.batch_size * self.world * self.access[t.name].pooling) / shards[t.name]),
            math.ceil(t.num_embeddings / shards[t.name])) for t in tables}
        cap = {t.name: math.ceil(t.num_embeddings / shards[t.name]) for t in tables}
        lookups = {t.name: self.shape.batch_size * self.world * self.access[t.name].pooling for t in tables}

        def used(rows: Mapping[str, int]) -> list[int]:
            out = [0] * self.world
            for t in tables:
                for r in holders[t.name]:
                    out[r] += rows[t.name] * self.shape.row_bytes(t)
            return out

        def fits(rows: Mapping[str, int]) -> bool:
            return all(u <= b for u, b in zip(used(rows), budgets))

        if not fits(floor):
            raise PlanError(f"a tier budget ({min(budgets) / 2**20:.1f} MiB on the smallest rank) is smaller than "
                            f"the rows the batches in flight touch ({max(used(floor)) / 2**20:.1f} MiB: "
                            f"{self.MIN_BATCHES} batches of {self.shape.batch_size} a rank); raise the budget or "
                            f"lower the batch size")
        if not self.skew_aware:  # the floors, then the rest in proportion to the tables' sizes
            spare = [b - u for b, u in zip(budgets, used(floor))]
            out = {}
            for t in tables:
                share = min(spare[r] * sizes[t.name] / max(sum(sizes[u.name] for u in tables if r in holders[u.name]), 1)
                            for r in holders[t.name])
                out[t.name] = min(floor[t.name] + int(share // self.shape.row_bytes(t)), cap[t.name])
            return out

        def rows_at(threshold: float) -> dict[str, int]:
            return {t.name: min(max(math.ceil(self.access[t.name].rows_above(
                threshold * self.shape.row_bytes(t) / lookups[t.name]) / shards[t.name]), floor[t.name]),
                cap[t.name]) for t in tables}

        lo, hi = 1e-30, 1e30  # lookups per step per byte: hi keeps nothing, lo everything
        if fits(rows_at(lo)):
            return rows_at(lo)
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            if fits(rows_at(mid)):
                hi = mid
            else:
                lo = mid
            if hi / lo < 1 + 1e-9:
                break
        return rows_at(hi)

    def _check_fits(self, placements: Sequence[TablePlacement], holders: Mapping[str, list[int]]) -> None:
        for rank in self.ranks:
            mine = [p for p in placements if rank.rank in holders[p.name]]
            ssd = sum(p.ssd_rows * p.row_bytes for p in mine) * SSD_OVERHEAD
            if ssd and rank.ssd_dir is None:
                raise PlanError(f"rank {rank.rank}: {ssd / 2**30:.2f} GiB of rows (with the log's "
                                f"{SSD_OVERHEAD}x) do not fit in the memory tiers and no writable SSD directory "
                                f"was found; tables: {[p.name for p in mine if p.ssd_rows]}")
            if ssd > rank.ssd_bytes:
                total = sum(p.rows // (self.world if p.sharding.kind == "row_wise" else 1) * p.row_bytes for p in mine)
                raise PlanError(
                    f"rank {rank.rank}: its tables hold {total / 2**30:.2f} GiB; the memory tiers take "
                    f"{(rank.device_bytes + rank.host_bytes) / 2**30:.2f} GiB and the rest needs "
                    f"{ssd / 2**30:.2f} GiB on SSD (with the log's {SSD_OVERHEAD}x), but {rank.ssd_dir} "
                    f"has {rank.ssd_bytes / 2**30:.2f} GiB for this rank")

    def choose_sharding(self, requested: str | Mapping[str, str]) -> dict[str, TableSharding]:
        """The requested sharding; for ``"auto"`` tables, the best for the slowest rank's
        estimate of the size rule of :func:`plan_sharding` and of every such table row-wise,
        table-wise or data-parallel (a replica on every rank, where it fits), then each table
        (largest first) moved to whichever of those kinds lowers that estimate."""
        shape, world = self.shape, self.world
        if isinstance(requested, str) and requested != "auto":
            return plan_sharding(shape.tables, world, requested)
        fixed = dict(requested) if isinstance(requested, Mapping) else {}
        start = {t.name: fixed.get(t.name, "auto") for t in shape.tables}
        free = [t.name for t in shape.tables if start[t.name] == "auto"]
        kinds = {n: s.kind for n, s in plan_sharding(shape.tables, world, start).items()}
        if world == 1 or not free:
            return plan_sharding(shape.tables, world, kinds)

        def worst(kinds: Mapping[str, str]) -> float:
            try:
                return max(e.seconds for e in self.place(plan_sharding(shape.tables, world, kinds))[1])
            except PlanError:
                return math.inf

        replicable = shape.sparse_sync == "step"  # k-step tables are replicas of what a rank touches already
        choices = ("row_wise", "table_wise") + (("data_parallel",) if replicable else ())
        # Every free table alike first: a kind's fixed costs (its collectives) may pay only
        # once several tables share them, which single moves would never find.
        kinds, best = min(((k, worst(k)) for k in [kinds] + [{**kinds, **{n: c for n in free}} for c in choices]),
                          key=lambda pair: pair[1])
        sizes = {t.name: t.num_embeddings * t.embedding_dim for t in shape.tables}
        for name in sorted(free, key=lambda n: -sizes[n]):
            for kind in choices:
                if kind == kinds[name]:
                    continue
                moved = {**kinds, name: kind}
                cost_moved = worst(moved)
                if cost_moved < best:
                    kinds, best = moved, cost_moved
        return plan_sharding(shape.tables, world, kinds)
