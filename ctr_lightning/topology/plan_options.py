"""How to plan: ranks, budgets and the choices left to the planner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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

    Example::

        plan(machine, shape, options=PlanOptions(num_nodes=2, ssd_dirs=("/mnt/nvme0",), sharding="auto"))
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
