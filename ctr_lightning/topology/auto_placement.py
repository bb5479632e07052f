"""``storage: auto``: each rank plans its tables' tiers from the machine it runs on."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.optimizers import SparseOptimizer
from ctr_lightning.embedding.sharding_plan import TableSharding
from ctr_lightning.embedding.storage_config import AutoStorage, StorageConfig
from ctr_lightning.topology.access_profile import TableAccess
from ctr_lightning.topology.discovery import discover
from ctr_lightning.topology.placement_plan import Plan, PlanError, RankPlacement
from ctr_lightning.topology.planner import ModelShape, PlanOptions, plan


@dataclass(frozen=True)
class Placement:
    """This rank's share of a plan: the whole plan, and where this rank sits in it (a
    :class:`~ctr_lightning.embedding.table_placer.PlacedTables`)."""

    plan: Plan
    rank: RankPlacement
    storage: dict[str, StorageConfig]

    @property
    def sharding_plan(self) -> dict[str, TableSharding]:
        """Per table, how it is split over the ranks (what the collection shards by)."""
        return {t.name: t.sharding for t in self.plan.tables}

    def bind_cpus(self) -> tuple[int, ...]:
        """Pin this process, every thread it has started (thread pools, gloo) and the
        DataLoader workers it starts later to its CPUs, with as many compute threads as it
        has CPUs."""
        if self.rank.cpus:
            for task in os.listdir("/proc/self/task"):  # sched_setaffinity moves one thread
                try:
                    os.sched_setaffinity(int(task), self.rank.cpus)
                except OSError:  # a thread that ended meanwhile
                    pass
            set_threads(len(self.rank.cpus))
        return self.rank.cpus


def _agreed(make: Callable[[], Plan], world: int, process_group: dist.ProcessGroup | None) -> Plan:
    """``make()`` on every rank; if it raises PlanError on any, all raise it (no rank is
    left waiting in the next collective)."""
    try:
        result, error = make(), None
    except PlanError as err:
        result, error = None, str(err)
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error, group=process_group)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, message = failed[0]
            raise PlanError(f"storage auto, rank {rank} of the group: {message}")
    elif error is not None:
        raise PlanError(error)
    return result


def set_threads(n: int) -> None:
    """``n`` threads for torch's and numba's parallel kernels alike: ranks that share cores
    and each start a thread per core wait on each other's spinning threads."""
    torch.set_num_threads(n)
    try:
        import numba

        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    except ImportError:
        pass


def place_tables(tables: Sequence[EmbeddingBagConfig], optimizer: SparseOptimizer,
                 sharding: str | Mapping[str, str], auto: AutoStorage, device: torch.device,
                 process_group: dist.ProcessGroup | None = None, batch_size: int = 4096,
                 access: Mapping[str, TableAccess] | None = None, sparse_sync: str = "step",
                 k: int = 1) -> Placement:
    """Plan the tiers of ``tables`` for this rank of ``process_group``, and their sharding
    (``sharding`` as requested; ``"auto"`` tables by the cost model). Collective when the
    group has more than one rank: the ranks tell each other their host names, so that
    ranks on one machine share it, and all take rank 0's sharding (budgets stay each
    rank's own, from what is free where it runs). A plan that fails on any rank fails on
    all of them, with that rank's message. ``sparse_sync`` and ``k`` price the tables'
    traffic as the collection syncs them. It is the
    :class:`~ctr_lightning.embedding.table_placer.TablePlacer` of ``storage="auto"``: the
    collection calls it when its tiers are built.

    Example::

        placement = place_tables(tables, SparseAdam(), "row_wise", AutoStorage(), torch.device("cpu"))
        placement.storage["t0"]     # StorageConfig(device_rows=..., ssd_dir=...)
    """
    world = process_group.size() if process_group is not None else 1
    rank = process_group.rank() if process_group is not None else 0
    hosts = [socket.gethostname()]
    if world > 1:
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=process_group)
    per_host = {h: hosts.count(h) for h in hosts}
    if len(set(per_host.values())) != 1:
        raise PlanError(f"storage auto: nodes run different numbers of ranks ({per_host}); the plan needs "
                        f"the same number on every node")
    ranks_per_node = per_host[hosts[rank]]
    local_rank = [r for r, h in enumerate(hosts) if h == hosts[rank]].index(rank)
    machine = discover(gpus=device.type == "cuda", gpu_memory_of=device.index if device.type == "cuda" else None)
    if device.type == "cuda" and len(machine.gpus) < ranks_per_node:
        raise PlanError(f"storage auto: {ranks_per_node} ranks on host {hosts[rank]} but this rank sees "
                        f"{len(machine.gpus)} GPU(s) (CUDA_VISIBLE_DEVICES?); the plan needs every GPU of the "
                        f"host visible to each rank")
    shape = ModelShape(tuple(tables), optimizer, batch_size, k=k, sparse_sync=sparse_sync)
    options = PlanOptions(num_nodes=world // ranks_per_node, ranks_per_node=ranks_per_node,
                          accelerator="gpu" if device.type == "cuda" else "cpu", ssd_dirs=auto.ssd_dirs,
                          dram_fraction=auto.dram_fraction, hbm_fraction=auto.hbm_fraction,
                          reserve_bytes=auto.reserve_bytes, sharding=sharding)
    result = _agreed(lambda: plan(machine, shape, access, options), world, process_group)
    if world > 1:  # one sharding for all: rank 0's (each rank's machine may differ in what is free)
        chosen = [result.sharding()]
        dist.broadcast_object_list(chosen, src=dist.get_global_rank(process_group, 0), group=process_group)
        if chosen[0] != result.sharding():
            fixed = dataclasses.replace(options, sharding=chosen[0])
            result = _agreed(lambda: plan(machine, shape, access, fixed), world, process_group)
        else:
            _agreed(lambda: result, world, process_group)  # the others may re-plan: meet them
    mine = result.ranks[local_rank]
    if device.type == "cuda" and device.index is not None:
        mine = next((r for r in result.ranks if r.node == 0 and r.gpu == device.index), mine)
    storage = {t.name: t.storage(mine.ssd_dir, result.accelerator == "gpu") for t in result.tables}
    return Placement(result, mine, storage)
