"""A placement plan: per table its sharding and tier split, per rank its devices, CPUs,
SSD directory and budgets, and the cost model's estimate of a step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ctr_lightning.embedding.sharding_plan import TableSharding
from ctr_lightning.embedding.storage_config import StorageConfig
from ctr_lightning.topology.cost_model import HardwareRates, StepEstimate


class PlanError(ValueError):
    """A plan that cannot fit: raised before training, with the numbers that do not."""


@dataclass(frozen=True)
class TablePlacement:
    """One table: its sharding and, on each rank holding it, rows per tier.

    ``device_coverage`` / ``host_coverage`` are the shares of its lookups the device tier,
    and the device and host tiers together, serve (estimated from the access profile).
    """

    name: str
    sharding: TableSharding
    rows: int
    row_bytes: int
    device_rows: int
    host_rows: int
    ssd_rows: int
    device_coverage: float
    host_coverage: float

    def storage(self, ssd_dir: str | None, host_tier: bool = False) -> StorageConfig:
        """This table's :class:`StorageConfig` on a rank whose SSD directory is ``ssd_dir``;
        ``host_tier``: the rank has a DRAM tier below the device (a GPU rank).

        With an SSD directory the tiers stay bounded even when the rows fit, so that a
        table growing past its expected rows spills to SSD instead of memory. Tables that
        share an SSD directory either all have a host tier or none: a table that fits its
        device tier gets a host tier of one row."""
        if ssd_dir is not None:
            host = max(self.host_rows, 1) if host_tier else 0
            return StorageConfig(device_rows=max(self.device_rows, 1), host_rows=host, ssd_dir=ssd_dir)
        if self.host_rows:
            return StorageConfig(device_rows=max(self.device_rows, 1))
        return StorageConfig()


@dataclass(frozen=True)
class RankPlacement:
    """One rank: where it runs and what it may use (budgets in bytes)."""

    rank: int
    node: int
    local_rank: int
    gpu: int | None
    numa_node: int | None
    cpus: tuple[int, ...]
    nic: str | None
    ssd_dir: str | None
    device_bytes: int
    host_bytes: int
    ssd_bytes: int


@dataclass(frozen=True)
class Plan:
    """What :func:`~ctr_lightning.topology.plan` decided.

    Example::

        p = plan(machine, shape)
        p.sharding()           # {"t_C1": "row_wise", ...} for TieredEmbeddingBagCollection
        p.storage(rank=0)      # {"t_C1": StorageConfig(...), ...}
        print(p.to_text())
    """

    num_nodes: int
    ranks_per_node: int
    accelerator: str
    tables: tuple[TablePlacement, ...]
    ranks: tuple[RankPlacement, ...]
    intra_groups: tuple[tuple[int, ...], ...]
    estimates: tuple[StepEstimate, ...]
    examples_per_step: int
    notes: tuple[str, ...] = ()
    rates: HardwareRates | None = None  # what the estimates were priced with

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def step_estimate(self) -> StepEstimate:
        """The slowest rank's estimate: every rank waits for it."""
        return max(self.estimates, key=lambda e: e.seconds)

    @property
    def examples_per_second(self) -> float:
        return self.examples_per_step / self.step_estimate.seconds

    def sharding(self) -> dict[str, str]:
        return {t.name: t.sharding.kind for t in self.tables}

    def storage(self, rank: int = 0) -> dict[str, StorageConfig]:
        return {t.name: t.storage(self.ranks[rank].ssd_dir, self.accelerator == "gpu") for t in self.tables}

    def torchrec_topology(self) -> Any:
        """The plan's cluster as torchrec's planner sees one (``torchrec.distributed.planner.
        types.Topology``): each rank's HBM / DDR / SSD budgets (the smallest rank's) and
        the rates in torchrec's units (bytes per millisecond), for torchrec's own
        ``EmbeddingShardingPlanner`` on the same machines."""
        from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, TopologyFactory, TrainerConfig

        gpu = self.accelerator == "gpu"
        rank = min(self.ranks, key=lambda r: (r.device_bytes, r.host_bytes))
        hardware = {}
        if self.rates is not None:
            per_ms = 1e-3
            hardware = dict(intra_host_bw=self.rates.intra_node_bw * per_ms,
                            inter_host_bw=self.rates.inter_node_bw * per_ms,
                            ddr_mem_bw=(self.rates.host_to_device_bw if gpu else self.rates.device_bw) * per_ms,
                            ssd_mem_bw=min(self.rates.ssd_read_bw, self.rates.ssd_read_iops * 4096) * per_ms)
            if gpu:
                hardware.update(hbm_mem_bw=self.rates.device_bw * per_ms,
                                hbm_to_ddr_mem_bw=self.rates.host_to_device_bw * per_ms)
        return TopologyFactory.create_topology(
            TrainerConfig(world_size=self.world_size, local_world_size=self.ranks_per_node,
                          hbm_cap_bytes=rank.device_bytes if gpu else 0,
                          ddr_cap_bytes=rank.host_bytes if gpu else rank.device_bytes,
                          ssd_cap_bytes=rank.ssd_bytes),
            HardwareConfig(**hardware),
            KernelConfig(compute_device="cuda" if gpu else "cpu", use_hardware_based_bandwidth=bool(hardware)))

    def to_text(self, machine_text: str = "") -> str:
        lines = [machine_text] if machine_text else []
        e = self.step_estimate
        lines.append(f"plan: {self.num_nodes} node(s) x {self.ranks_per_node} rank(s) ({self.accelerator}), "
                     f"{self.examples_per_step} examples a step")
        lines.append(f"estimated step {e.seconds * 1e3:.2f} ms ({self.examples_per_second:,.0f} examples/s); "
                     + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in e.parts.items()))
        lines.append("bytes a step on the slowest rank: "
                     + ", ".join(f"{k} {_size(v)}" for k, v in e.link_bytes.items()))
        lines.append("")
        lines.append(f"{'table':<16} {'sharding':<14} {'rows':>13} {'row B':>6} {'device rows':>12} "
                     f"{'host rows':>11} {'ssd rows':>13} {'dev hit':>8} {'+host':>6}")
        for t in self.tables:
            kind = t.sharding.kind + (f"@{t.sharding.owner}" if t.sharding.kind == "table_wise" else "")
            lines.append(f"{t.name:<16} {kind:<14} {t.rows:>13,} {t.row_bytes:>6} {t.device_rows:>12,} "
                         f"{t.host_rows:>11,} {t.ssd_rows:>13,} {t.device_coverage:>8.3f} {t.host_coverage:>6.3f}")
        lines.append("")
        lines.append(f"{'rank':>4} {'node':>4} {'gpu':>4} {'numa':>4} {'cpus':<14} {'nic':<10} {'ssd dir':<28} "
                     f"{'device':>9} {'host':>9} {'ssd':>9} {'est. ms':>8}")
        for r, est in zip(self.ranks, self.estimates):
            lines.append(f"{r.rank:>4} {r.node:>4} {_opt(r.gpu):>4} {_opt(r.numa_node):>4} {_cpus(r.cpus):<14} "
                         f"{_opt(r.nic):<10} {_opt(r.ssd_dir):<28} {_size(r.device_bytes):>9} "
                         f"{_size(r.host_bytes):>9} {_size(r.ssd_bytes):>9} {est.seconds * 1e3:>8.2f}")
        if self.intra_groups:
            hint = ' (KStepAdamStrategy(local_world_size="nvlink") syncs each step within them)' \
                if len(self.intra_groups) > 1 else ""
            lines.append(f"per-step groups (local ranks, NVLink islands first): {[list(g) for g in self.intra_groups]}"
                         + hint)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _cpus(cpus: Sequence[int]) -> str:
    if not cpus:
        return "-"
    return ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in cpu_runs(cpus))


def cpu_runs(cpus: Sequence[int]) -> list[list[int]]:
    """The runs of consecutive CPU numbers, in order: ``[0, 1, 2, 8, 9]`` -> ``[[0, 1, 2], [8, 9]]``."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs
