"""The planner: ranks onto GPUs, NUMA nodes, NICs and drives; tables onto ranks and tiers,
chosen by the cost model."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.optimizers import SparseAdam, SparseOptimizer
from ctr_lightning.embedding.sharding_plan import SHARDING_KINDS, TableSharding, plan_sharding
from ctr_lightning.embedding.sparse_update import state_width
from ctr_lightning.topology.access_profile import TableAccess
from ctr_lightning.topology.cost_model import HardwareRates, StepEstimate, TableLoad, estimate_step
from ctr_lightning.topology.machine import Drive, FileSystem, Machine
from ctr_lightning.topology.placement_plan import Plan, PlanError, RankPlacement, TablePlacement, cpu_runs

SSD_OVERHEAD = 1.5  # the SSD log's files stay under 1.5x the live rows
SSD_TYPICAL = 1.3  # and hold about 1.3x once cleaning runs


@dataclass(frozen=True)
class ModelShape:
    """What is placed: the tables, their optimizer, a rank's batch and the dense part's size.

    Example::

        shape = ModelShape.dlrm(tables, SparseAdam(), batch_size=4096, dense_in=13,
                                bottom=(512, 256), top=(1024, 1024, 512, 256, 1))
    """

    tables: tuple[EmbeddingBagConfig, ...]
    optimizer: SparseOptimizer = field(default_factory=SparseAdam)
    batch_size: int = 4096  # per rank
    dense_flops_per_example: float = 0.0  # forward and backward
    dense_params: int = 0
    k: int = 1  # the dense merge interval; k > 1 merges across nodes every k steps
    sparse_sync: str = "step"
    dlrm_layers: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None  # dense_in, bottom, top

    def row_bytes(self, table: EmbeddingBagConfig) -> int:
        return (table.embedding_dim + state_width(self.optimizer, table.embedding_dim)) * 4

    @staticmethod
    def dlrm(tables: Sequence[EmbeddingBagConfig], optimizer: SparseOptimizer, batch_size: int, dense_in: int,
             bottom: Sequence[int], top: Sequence[int], k: int = 1, sparse_sync: str = "step") -> ModelShape:
        """A DLRM's shape (torchrec's: bottom MLP to the embedding width, dot interaction,
        top MLP); ``bottom`` without its last layer, which is the embedding width."""
        dim = tables[0].embedding_dim
        f = sum(len(t.feature_names) for t in tables)
        widths = [dense_in, *bottom, dim]
        over = [dim + (f + 1) * f // 2, *top]
        matmuls = [(a, b) for a, b in zip(widths, widths[1:])] + [(a, b) for a, b in zip(over, over[1:])]
        params = sum(a * b + b for a, b in matmuls)
        flops = 2 * sum(a * b for a, b in matmuls) + 2 * (f + 1) ** 2 * dim / 2
        return ModelShape(tuple(tables), optimizer, batch_size, 3 * flops, params, k, sparse_sync,
                          (dense_in, tuple(bottom), tuple(top)))


@dataclass(frozen=True)
class PlanOptions:
    """How to plan: ranks, budgets and the choices left to the planner.

    ``ssd_dirs``: directories the SSD tiers may use (several mount points spread the
    ranks over drives); empty: a ``ctr-lightning-ssd`` folder on every writable drive.
    Budgets not given are taken from what is free: ``dram_fraction`` of a NUMA node's
    free memory less ``reserve_bytes`` per rank (the process outside its tiers: Python,
    torch, the data loader), ``hbm_fraction`` of a GPU's free memory.
    ``sharding`` fixes it per table (or for all); ``"auto"`` lets the cost model pick.
    ``constraints`` takes torchrec's ``ParameterConstraints`` per table: its
    ``sharding_types`` limit the choice, its ``pooling_factors`` set the ids per example.
    """

    num_nodes: int = 1
    ranks_per_node: int | None = None
    accelerator: str = "auto"
    ssd_dirs: tuple[str, ...] = ()
    dram_fraction: float = 0.5
    hbm_fraction: float = 0.7
    reserve_bytes: int = 2 << 30
    ssd_fraction: float = 0.9
    device_bytes: int | None = None
    host_bytes: int | None = None
    sharding: str | Mapping[str, str] = "auto"
    skew_aware: bool = True
    constraints: Mapping[str, Any] = field(default_factory=dict)


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
    accelerator = _accelerator(machine, options.accelerator)
    rpn = options.ranks_per_node or (len(machine.gpus) if accelerator == "gpu" else 1)
    if rpn < 1 or options.num_nodes < 1:
        raise PlanError(f"ranks per node ({rpn}) and nodes ({options.num_nodes}) must be >= 1")
    if accelerator == "gpu" and rpn > len(machine.gpus):
        raise PlanError(f"{rpn} ranks per node but the machine has {len(machine.gpus)} GPU(s)")
    world = rpn * options.num_nodes
    access = dict(access or {})
    for t in shape.tables:
        access.setdefault(t.name, TableAccess.zipf(t.num_embeddings, 1.05, pooling=1.0))
    requested = _apply_constraints(shape, options, access)
    local = _place_local_ranks(machine, shape, options, accelerator, rpn)
    ranks = tuple(RankPlacement(node * rpn + r.local_rank, node, r.local_rank, r.gpu, r.numa_node, r.cpus, r.nic,
                                r.ssd_dir, r.device_bytes, r.host_bytes, r.ssd_bytes)
                  for node in range(options.num_nodes) for r in local)
    groups = _intra_groups(machine, local, accelerator)
    cost = _Pricing(shape, access, ranks, rpn, accelerator, options.skew_aware,
                    rates or _rates(machine, local, accelerator))
    sharding = _choose_sharding(shape, world, requested, cost)
    tables, estimates = cost.price(sharding)
    notes = list(machine.notes)
    if rates is None:
        notes.append(f"rates: published figures for {cost.rates.name} (HardwareRates.published)")
    return Plan(options.num_nodes, rpn, accelerator, tables, ranks, groups, estimates,
                shape.batch_size * world, tuple(notes), cost.rates)


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


def _accelerator(machine: Machine, requested: str) -> str:
    if requested in ("gpu", "cuda"):
        if not machine.gpus:
            raise PlanError("accelerator gpu asked for, but the machine has no GPU")
        return "gpu"
    if requested == "cpu":
        return "cpu"
    if requested != "auto":
        raise PlanError(f"accelerator must be 'auto', 'gpu' or 'cpu', got {requested!r}")
    return "gpu" if machine.gpus else "cpu"


def _rates(machine: Machine, local: Sequence[RankPlacement], accelerator: str) -> HardwareRates:
    gpu = machine.gpus[local[0].gpu] if accelerator == "gpu" and local[0].gpu is not None else None
    nic = next((n for n in machine.nics if n.name == local[0].nic), None)
    rates = HardwareRates.for_machine(machine, gpu, nic.speed_mbps if nic else None, cpus=len(local[0].cpus))
    # The NIC's bandwidth is shared by the ranks it serves.
    users = sum(1 for r in local if r.nic == local[0].nic) or 1
    return rates if users == 1 else dataclasses.replace(rates, inter_node_bw=rates.inter_node_bw / users)


# ----------------------------------------------------------------------------- ranks


def _place_local_ranks(machine: Machine, shape: ModelShape, options: PlanOptions, accelerator: str,
                       rpn: int) -> list[RankPlacement]:
    if accelerator == "gpu":
        # NVLink islands first, so that consecutive local ranks share one.
        order = [g for group in (machine.nvlink_groups or ((),)) for g in group] or []
        order += [g.index for g in machine.gpus if g.index not in order]
        gpus = order[:rpn]
        numa = [machine.gpus[g].numa_node for g in gpus]
    else:
        gpus = [None] * rpn
        nodes = [n.id for n in machine.numa_nodes if n.cpus] or [None]
        numa = [nodes[i * len(nodes) // rpn] for i in range(rpn)]  # contiguous blocks of ranks per node
    cpus = _cpu_sets(machine, numa)
    nics = _nearest(machine.nics, machine, gpus, numa)
    drives = _ssd_dirs(machine, options, gpus, numa)
    memory = _dram_budgets(machine, options, numa)
    out = []
    for i in range(rpn):
        gpu = machine.gpus[gpus[i]] if gpus[i] is not None else None
        if accelerator == "gpu":
            hbm = options.device_bytes or int((gpu.free_bytes or gpu.memory_bytes or 0) * options.hbm_fraction)
            device, host = hbm, options.host_bytes if options.host_bytes is not None else memory[i]
        else:  # the compute tier is DRAM already: no host tier below it
            device, host = options.device_bytes or memory[i], 0
        ssd_dir, ssd_bytes = drives[i]
        out.append(RankPlacement(i, 0, i, gpus[i], numa[i], cpus[i], nics[i], ssd_dir, device, host, ssd_bytes))
    return out


def _cpu_sets(machine: Machine, numa: Sequence[int | None]) -> list[tuple[int, ...]]:
    """Each rank a disjoint, contiguous share of its NUMA node's CPUs (of all CPUs when
    its node is unknown); the rank's DataLoader workers run on the same CPUs."""
    allowed = set(machine.cpus)
    pools: dict[int | None, list[int]] = {}
    for node in set(numa):
        cpus = next((n.cpus for n in machine.numa_nodes if n.id == node), ())
        # A node whose CPUs this process may not use (a container pinned to another
        # socket), or not known: the rank shares all CPUs it may use.
        pools[node] = [c for c in cpus if c in allowed] or sorted(allowed)
    out = []
    for i, node in enumerate(numa):
        peers = [j for j, n in enumerate(numa) if n == node]
        k = peers.index(i)
        # Each contiguous run split in turn: Linux numbers a core's second hardware thread
        # in a later run (48-63 and 176-191), so a rank gets whole cores.
        mine: list[int] = []
        for run in cpu_runs(pools[node]):
            lo, hi = len(run) * k // len(peers), len(run) * (k + 1) // len(peers)
            mine += run[lo:hi]
        out.append(tuple(mine or pools[node][k % len(pools[node]):][:1]))
    return out


def _affinity(path: Sequence[str], numa: int | None, device_numa: int | None, device_path: Sequence[str]) -> tuple:
    """Sort key, nearest first: same NUMA node, then the longest shared PCIe path."""
    shared = 0
    for a, b in zip(path, device_path):
        if a != b:
            break
        shared += 1
    return (0 if numa is None or device_numa is None or numa == device_numa else 1, -shared)


def _nearest(nics: Sequence, machine: Machine, gpus: Sequence[int | None],
             numa: Sequence[int | None]) -> list[str | None]:
    if not nics:
        return [None] * len(numa)
    load: dict[str, int] = {n.name: 0 for n in nics}
    out = []
    for gpu, node in zip(gpus, numa):
        path = machine.gpus[gpu].pcie_path if gpu is not None else ()
        # Nearest first, then the fastest (not a slow management port), then the least used.
        best = min(nics, key=lambda n: (*_affinity(n.pcie_path, node, n.numa_node, path), -(n.speed_mbps or 0),
                                        load[n.name], n.name))
        load[best.name] += 1
        out.append(best.name)
    return out


def _ssd_dirs(machine: Machine, options: PlanOptions, gpus: Sequence[int | None],
              numa: Sequence[int | None]) -> list[tuple[str | None, int]]:
    """Per rank an SSD directory and its share of the file system's free bytes: drives on
    the rank's NUMA node first, NVMe before others, spread so that ranks share a drive
    only when there are more ranks than drives."""
    candidates: list[tuple[Drive | None, FileSystem, str]] = []
    if options.ssd_dirs:
        for d in options.ssd_dirs:
            drive, fs = _file_system_of(machine, d)
            candidates.append((drive, fs, d))
    else:
        for drive in machine.drives:
            # One directory per drive, on its roomiest writable file system: bind mounts
            # and other partitions of it add no bandwidth.
            usable = [fs for fs in drive.file_systems if fs.writable and (fs.free_bytes or 0) > 0]
            if usable:
                fs = max(usable, key=lambda f: (f.free_bytes or 0, -len(f.mount_point)))
                candidates.append((drive, fs, os.path.join(fs.mount_point, "ctr-lightning-ssd")))
    if not candidates:
        return [(None, 0)] * len(numa)
    users: dict[str, int] = {c[2]: 0 for c in candidates}
    chosen = []
    for gpu, node in zip(gpus, numa):
        path = machine.gpus[gpu].pcie_path if gpu is not None else ()

        def key(c: tuple[Drive | None, FileSystem, str]) -> tuple:
            drive = c[0]
            near = _affinity(drive.pcie_path if drive else (), node, drive.numa_node if drive else None, path)
            return (near, users[c[2]], 0 if drive is not None and drive.kind == "nvme" else 1,
                    -(c[1].free_bytes or 0), c[2])

        best = min(candidates, key=key)
        users[best[2]] += 1
        chosen.append(best)
    out = []
    for drive, fs, directory in chosen:
        free = fs.free_bytes or 0
        sharing = sum(1 for c in chosen if c[1].mount_point == fs.mount_point)
        out.append((directory, int(free * options.ssd_fraction / sharing)))
    return out


def _file_system_of(machine: Machine, directory: str) -> tuple[Drive | None, FileSystem]:
    best: tuple[Drive | None, FileSystem] | None = None
    path = os.path.realpath(directory)
    for drive, fs in machine.file_systems():
        mount = fs.mount_point.rstrip("/") or "/"
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and (
                best is None or len(mount) > len(best[1].mount_point)):
            best = (drive, fs)
    if best is None and machine.hostname == socket.gethostname():
        # This machine, on a file system of no listed drive (a container's overlay root):
        # the directory's own file system, as statvfs sees it.
        existing = path
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        st = os.statvfs(existing)
        best = (None, FileSystem(existing, "?", st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize,
                                 os.access(existing, os.W_OK) and not st.f_flag & os.ST_RDONLY))
    if best is None:
        raise PlanError(f"ssd_dir {directory!r} is on no file system the machine description lists "
                        f"({[fs.mount_point for _, fs in machine.file_systems()]})")
    if not best[1].writable:
        raise PlanError(f"ssd_dir {directory!r}: file system {best[1].mount_point} is not writable")
    return best


def _dram_budgets(machine: Machine, options: PlanOptions, numa: Sequence[int | None]) -> list[int]:
    out = []
    for node in numa:
        peers = sum(1 for n in numa if n == node)
        if node is None:
            free = machine.free_memory_bytes
        else:
            free = next((n.free_bytes for n in machine.numa_nodes if n.id == node), None)
            everywhere = sum(n.free_bytes or 0 for n in machine.numa_nodes)
            if machine.memory_limit_bytes is not None and free is not None and everywhere:
                # A cgroup's limit, shared out over the nodes as their free memory is.
                free = min(free, machine.memory_limit_bytes * free // everywhere)
        if free is None:
            raise PlanError(f"free memory of NUMA node {node} is unknown: give the DRAM budget "
                            f"(device_bytes on CPU, host_bytes on GPU)")
        budget = int(free * options.dram_fraction / peers) - options.reserve_bytes
        if budget <= 0 and options.host_bytes is None and options.device_bytes is None:
            raise PlanError(f"NUMA node {node}: {free / 2**30:.1f} GiB free x {options.dram_fraction} over {peers} "
                            f"rank(s) leaves nothing above the {options.reserve_bytes / 2**30:.1f} GiB each rank "
                            f"needs outside its tiers")
        out.append(max(budget, 0))
    return out


def nvlink_group_size(machine: Machine, ranks_per_node: int) -> int:
    """Ranks per k-step "node" when ranks one per GPU follow the NVLink islands: the
    islands' size when they are equal, contiguous in GPU order, larger than one GPU and
    divide the node's ranks; else the whole node.

    Example::

        KStepAdamStrategy(mode="node", local_world_size=nvlink_group_size(discover(), 8))
    """
    islands = [g for g in (machine.nvlink_groups or ()) if any(i < ranks_per_node for i in g)]
    sizes = {len(g) for g in islands}
    contiguous = all(tuple(g) == tuple(range(g[0], g[0] + len(g))) for g in islands)
    if len(sizes) == 1 and contiguous and 1 < (size := sizes.pop()) < ranks_per_node and ranks_per_node % size == 0:
        return size
    return ranks_per_node


def _intra_groups(machine: Machine, local: Sequence[RankPlacement], accelerator: str) -> tuple[tuple[int, ...], ...]:
    """Local ranks by NVLink island (the k-step strategy's per-step groups); one group of
    all local ranks when the islands are unknown or this is a CPU node."""
    if accelerator != "gpu" or not machine.nvlink_groups:
        return (tuple(r.local_rank for r in local),)
    groups = []
    for island in machine.nvlink_groups:
        members = tuple(r.local_rank for r in local if r.gpu in island)
        if members:
            groups.append(members)
    return tuple(groups)


# ----------------------------------------------------------------------------- tables


class _Pricing:
    """Tier splits and the cost model's estimate for a given sharding."""

    MIN_BATCHES = 2  # batches whose rows a tier holds at once: the step's and the next one's

    def __init__(self, shape: ModelShape, access: Mapping[str, TableAccess], ranks: Sequence[RankPlacement],
                 rpn: int, accelerator: str, skew_aware: bool, rates: HardwareRates) -> None:
        self.shape, self.access, self.ranks, self.rpn = shape, access, ranks, rpn
        self.accelerator, self.skew_aware, self.rates = accelerator, skew_aware, rates
        self.world = len(ranks)
        # Ranks of one sharding, and shardings tried one after another, ask the same questions.
        self._answers: dict[tuple[str, str, float, int], float] = {}

    def unique(self, table: str, lookups: float, skip: int = 0) -> float:
        return self._ask("unique", table, lookups, skip)

    def misses(self, table: str, lookups: float, cache_rows: int) -> float:
        return self._ask("lru_misses", table, lookups, cache_rows)

    def _ask(self, question: str, table: str, lookups: float, rows: int) -> float:
        key = (question, table, lookups, rows)
        if key not in self._answers:
            self._answers[key] = getattr(self.access[table], question)(lookups, rows)
        return self._answers[key]

    def price(self, sharding: Mapping[str, TableSharding]) -> tuple[tuple[TablePlacement, ...], tuple[StepEstimate, ...]]:
        shape, world = self.shape, self.world
        shards = {t.name: (world if sharding[t.name].kind == "row_wise" else 1) for t in shape.tables}
        holders = {t.name: (list(range(world)) if sharding[t.name].kind in ("row_wise", "data_parallel")
                            else [sharding[t.name].owner]) for t in shape.tables}
        device = self._split([r.device_bytes for r in self.ranks], shards, holders)
        cached = self._split([r.device_bytes + r.host_bytes for r in self.ranks], shards, holders)
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
        estimates = tuple(self._estimate(rank, placements, holders) for rank in range(world))
        return tuple(placements), estimates

    def _split(self, budgets: Sequence[int], shards: Mapping[str, int],
               holders: Mapping[str, list[int]]) -> dict[str, int]:
        """Rows per shard of each table within every rank's budget: skew-aware, each byte
        to the row that serves the most lookups per byte (one threshold for all tables,
        the lowest that fits every rank), or in proportion to the tables' sizes."""
        tables = self.shape.tables
        sizes = {t.name: math.ceil(t.num_embeddings / shards[t.name]) * self.shape.row_bytes(t) for t in tables}
        # A tier holds at least the rows of the batches in flight (the step's and the
        # prefetcher's), or a step cannot run.
        floor = {t.name: min(math.ceil(self.MIN_BATCHES * self.unique(
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

    def _estimate(self, rank: int, placements: Sequence[TablePlacement], holders: Mapping[str, list[int]]) -> StepEstimate:
        shape, world, rpn = self.shape, self.world, self.rpn
        b = shape.batch_size
        loads, sent = [], 0.0
        configs = {t.name: t for t in shape.tables}
        for p in placements:
            t, acc = configs[p.name], self.access[p.name]
            dim = t.embedding_dim
            global_lookups = b * world * acc.pooling
            replica = p.sharding.kind == "data_parallel" and world > 1
            if rank in holders[p.name]:
                n = world if p.sharding.kind == "row_wise" else 1
                # A replica pools its own batch, then steps one bag a rank's distinct id.
                lookups = (b * acc.pooling + world * self.unique(p.name, b * acc.pooling) if replica
                           else global_lookups / n)
                # The tiers are LRU caches: their misses by Che's approximation.
                loads.append(TableLoad(
                    p.name, lookups, self.unique(p.name, global_lookups) / n,
                    self.misses(p.name, global_lookups, p.device_rows * n) / n,
                    self.misses(p.name, global_lookups, (p.device_rows + p.host_rows) * n) / n, p.row_bytes, dim,
                    p.ssd_rows * p.row_bytes * SSD_TYPICAL))
            if world == 1 or shape.sparse_sync != "step":
                continue
            ids = b * acc.pooling * 8
            if p.sharding.kind == "row_wise":
                sent += ids * (world - 1) / world + 2 * (world - 1) * b * dim * 4
            elif replica:  # each rank's distinct ids and their row gradients, to every rank
                sent += (world - 1) * self.unique(p.name, b * acc.pooling) * (8 + dim * 4)
            elif p.sharding.owner == rank:
                sent += (world - 1) * b * dim * 4
            else:
                sent += ids + b * dim * 4
        if world > 1 and shape.sparse_sync != "step":
            # k-step tables: the rows a rank touches in an interval are pulled and pushed
            # once per k steps, weights in float32 and optimizer state in bfloat16.
            k = max(shape.k, 1)
            for t in shape.tables:
                acc = self.access[t.name]
                wire = t.embedding_dim * 4 + state_width(shape.optimizer, t.embedding_dim) * 2
                sent += 2 * self.unique(t.name, b * k * acc.pooling) * wire * (world - 1) / world / k
        dense = shape.dense_params * 4 * 2 * (world - 1) / world if world > 1 else 0.0
        remote = (world - rpn) / (world - 1) if world > 1 else 0.0
        k = max(shape.k, 1)
        intra = sent * (1 - remote) + dense * (1 - remote)
        inter = sent * remote + dense * remote / k
        replicated = {p.name for p in placements if p.sharding.kind == "data_parallel"}
        sharded = len(replicated) < len(placements)
        # Sharded tables' all-to-alls (ids, lengths, pooled rows, their gradients; one merge
        # under k-step), the dense part's all-reduce, the replicas' all-gathers.
        collectives = 0
        if world > 1:
            collectives = ((4 if shape.sparse_sync == "step" else 1) if sharded else 0) + 1
            if shape.sparse_sync == "step" and replicated:
                collectives += 3  # the replicas' gradients: counts, ids, rows
        bags = routed = replica_rows = 0.0
        if world > 1 and shape.sparse_sync == "step":
            features = {t.name: len(t.feature_names) for t in shape.tables}
            # Beyond one bag an example and feature of its own batch, a shard pools every
            # rank's examples; a replica pools its own and applies a row gradient a rank's distinct id.
            bags = sum(b * world * features[p.name] for p in placements
                       if rank in holders[p.name] and p.name not in replicated)
            bags -= b * sum(features[p.name] for p in placements if p.name not in replicated)
            replica_rows = sum(world * self.unique(name, b * self.access[name].pooling) for name in replicated)
            routed = b * sum(features[p.name] for p in placements if p.name not in replicated)
        return estimate_step(self.rates, loads, shape.dense_flops_per_example * b, intra, inter, collectives,
                             host_tier=self.accelerator == "gpu", extra_bags=bags, routed=routed,
                             replica_rows=replica_rows)


def _choose_sharding(shape: ModelShape, world: int, requested: str | Mapping[str, str],
                     cost: _Pricing) -> dict[str, TableSharding]:
    """The requested sharding; for ``"auto"`` tables, the best for the slowest rank's
    estimate of the size rule of :func:`plan_sharding` and of every such table row-wise,
    table-wise or data-parallel (a replica on every rank, where it fits), then each table
    (largest first) moved to whichever of those kinds lowers that estimate."""
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
            return max(e.seconds for e in cost.price(plan_sharding(shape.tables, world, kinds))[1])
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
