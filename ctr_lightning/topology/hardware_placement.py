"""Ranks onto a machine's hardware: each rank's GPU, NUMA node, CPUs, NIC and SSD
directory, and its memory budgets (device, host and SSD bytes)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from ctr_lightning.topology.machine import Drive, FileSystem, Machine
from ctr_lightning.topology.placement_plan import PlanError, RankPlacement, cpu_runs
from ctr_lightning.topology.plan_options import PlanOptions


def accelerator_for(machine: Machine, requested: str) -> str:
    """``"gpu"`` or ``"cpu"``: ``requested`` (``"auto"``: the GPUs where the machine has any)."""
    if requested in ("gpu", "cuda"):
        if not machine.gpus:
            raise PlanError("accelerator gpu asked for, but the machine has no GPU")
        return "gpu"
    if requested == "cpu":
        return "cpu"
    if requested != "auto":
        raise PlanError(f"accelerator must be 'auto', 'gpu' or 'cpu', got {requested!r}")
    return "gpu" if machine.gpus else "cpu"


def ranks_per_node(machine: Machine, options: PlanOptions, accelerator: str) -> int:
    """``options.ranks_per_node``, by default one per GPU (one on a CPU node)."""
    rpn = options.ranks_per_node or (len(machine.gpus) if accelerator == "gpu" else 1)
    if rpn < 1 or options.num_nodes < 1:
        raise PlanError(f"ranks per node ({rpn}) and nodes ({options.num_nodes}) must be >= 1")
    if accelerator == "gpu" and rpn > len(machine.gpus):
        raise PlanError(f"{rpn} ranks per node but the machine has {len(machine.gpus)} GPU(s)")
    return rpn


def place_local_ranks(machine: Machine, options: PlanOptions, accelerator: str, rpn: int) -> list[RankPlacement]:
    """One node's ``rpn`` ranks (``rank == local_rank``, node 0): each next to its GPU, in
    NVLink-island order (CPU ranks in contiguous blocks per NUMA node), with its share of
    the node's CPUs, the nearest NIC and drive, and its budgets.

    Example::

        local = place_local_ranks(machine, PlanOptions(), "gpu", len(machine.gpus))
        local[0].numa_node, local[0].cpus, local[0].ssd_dir
    """
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


def intra_groups(machine: Machine, local: Sequence[RankPlacement], accelerator: str) -> tuple[tuple[int, ...], ...]:
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
