"""The planner's cost model: what one training step costs a rank, from the bytes each link
and tier moves and the rates of the hardware."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ctr_lightning.topology.machine import Gpu, Machine

GB = 1e9
SSD_PAGE = 4096


@dataclass(frozen=True)
class HardwareRates:
    """Rates of one rank's hardware, in bytes/s, FLOP/s and seconds.

    ``device_bw`` is the memory the compute reads tables from (HBM; DRAM on a CPU rank),
    ``host_to_device_bw`` the DRAM -> device link (PCIe), ``intra_node_bw`` and
    ``inter_node_bw`` one rank's share of the links to ranks on its node (NVLink, shared
    memory) and on other nodes (its NIC). ``row_op_s`` is the fixed cost of each distinct
    row a step touches (index lookup, optimizer update), ``lookup_op_s`` of each id pooled,
    ``step_overhead_s`` of a step whatever its size.

    Example::

        rates = HardwareRates.published("a100-80gb")
        rates.device_bw     # 2.0e12
    """

    name: str
    device_bw: float
    host_to_device_bw: float
    ssd_read_iops: float
    ssd_read_bw: float
    ssd_write_bw: float
    intra_node_bw: float
    inter_node_bw: float
    collective_latency_s: float
    dense_flops: float
    row_op_s: float
    lookup_op_s: float
    step_overhead_s: float = 0.0  # per step, whatever the size: kernel launches, Python, the data's hand-over
    ssd_read_unit: int = SSD_PAGE  # bytes a random read of a row brings in (the page, or what the drive reads ahead)
    bag_op_s: float = 0.0  # per bag a rank pools for another rank's example (row-wise partial sums)
    example_op_s: float = 0.0  # per example and feature a sharded step routes to its owner and back
    replica_op_s: float = 0.0  # per row gradient a data-parallel replica applies (one a rank's distinct id)

    @staticmethod
    def published(kind: str) -> HardwareRates:
        """Rates from vendors' published figures, for ``kind`` in :data:`PUBLISHED`."""
        try:
            return PUBLISHED[kind]
        except KeyError:
            raise ValueError(f"no published rates for {kind!r}; known: {sorted(PUBLISHED)}") from None

    @staticmethod
    def for_machine(machine: Machine, gpu: Gpu | None = None, nic_mbps: int | None = None,
                    cpus: int = 1) -> HardwareRates:
        """Published rates for ``gpu``'s model, else for a CPU rank of ``cpus`` cores (the
        per-core compute and memory rates times the cores), with the NIC's speed."""
        cpu = PUBLISHED["cpu"]
        n = max(cpus, 1)
        # A socket's memory channels cap what its cores read together (8 DDR4-3200 channels: 200 GB/s).
        bw = min(cpu.device_bw * n, 150 * GB)
        rates = dataclasses.replace(cpu, device_bw=bw, host_to_device_bw=bw,
                                    dense_flops=cpu.dense_flops * n, row_op_s=cpu.row_op_s / n,
                                    lookup_op_s=cpu.lookup_op_s / n)
        if gpu is not None:
            name = (gpu.name or "").lower()
            kind = next((k for k in ("h200", "h100", "a100") if k in name), None)
            if kind == "a100" and (gpu.memory_bytes or 0) > 60 * 2**30:
                kind = "a100-80gb"
            # Other GPUs are priced as an A100 and say so (the placement does not depend on it).
            rates = PUBLISHED[kind] if kind else dataclasses.replace(_A100, name=f"a100, standing in for {gpu.name!r}")
        if nic_mbps:
            rates = dataclasses.replace(rates, inter_node_bw=nic_mbps * 1e6 / 8)
        return rates


_A100 = HardwareRates(
    name="a100", device_bw=1.555e12, host_to_device_bw=25 * GB, ssd_read_iops=500e3, ssd_read_bw=3 * GB,
    ssd_write_bw=2 * GB, intra_node_bw=240 * GB, inter_node_bw=25 * GB, collective_latency_s=30e-6,
    dense_flops=0.6 * 19.5e12, row_op_s=1e-9, lookup_op_s=0.2e-9, step_overhead_s=2e-3)
PUBLISHED: dict[str, HardwareRates] = {
    # A100 SXM: HBM2e 1.56 / 2.04 TB/s, NVLink 3 at 300 GB/s a direction (about 240 usable
    # for all-to-all), PCIe 4 x16, one 200 Gb/s HDR NIC per GPU (DGX A100). Dense layers at
    # 60% of the FP32 peak (19.5 TFLOP/s): PyTorch leaves TF32 off for matmuls by default.
    # About 400 kernel launches a training step at ~5 us each: 2 ms a step.
    "a100": _A100,
    "a100-80gb": dataclasses.replace(_A100, name="a100-80gb", device_bw=2.0e12),
    # H100 SXM: HBM3 3.35 TB/s, NVLink 4 at 450 GB/s a direction, PCIe 5, 400 Gb/s NDR, FP32 67 TFLOP/s.
    "h100": dataclasses.replace(_A100, name="h100", device_bw=3.35e12, host_to_device_bw=50 * GB,
                                intra_node_bw=360 * GB, inter_node_bw=50 * GB, dense_flops=0.6 * 67e12),
    "h200": dataclasses.replace(_A100, name="h200", device_bw=4.8e12, host_to_device_bw=50 * GB,
                                intra_node_bw=360 * GB, inter_node_bw=50 * GB, dense_flops=0.6 * 67e12),
    # One server core (for_machine scales by a rank's cores): DRAM read by random rows, loopback / shared memory between
    # ranks, a data-centre NVMe drive, 25 Gb/s Ethernet. Calibrate for a real machine.
    "cpu": HardwareRates(
        name="cpu", device_bw=10 * GB, host_to_device_bw=10 * GB, ssd_read_iops=200e3, ssd_read_bw=2 * GB,
        ssd_write_bw=1 * GB, intra_node_bw=5 * GB, inter_node_bw=25e9 / 8, collective_latency_s=50e-6,
        dense_flops=50e9, row_op_s=40e-9, lookup_op_s=5e-9),
}


@dataclass(frozen=True)
class TableLoad:
    """One table's work on one rank in one step (rows are this rank's rows of it)."""

    name: str
    lookups: float  # ids pooled
    unique_rows: float  # distinct rows touched
    device_misses: float  # of those, rows not in the device tier
    ssd_misses: float  # rows in neither the device nor the host tier
    row_bytes: int  # weights and optimizer state
    dim: int
    ssd_file_bytes: float = 0.0  # this table's rows in the SSD tier's files, garbage included


@dataclass(frozen=True)
class StepEstimate:
    """One rank's estimated step: seconds per part, and bytes per step on each link or tier.

    Example::

        estimate.seconds, estimate.parts["tables"], estimate.link_bytes["inter-node"]
    """

    seconds: float
    parts: dict[str, float]
    link_bytes: dict[str, float]
    ssd_rows: float = 0.0  # rows read from SSD


def estimate_step(rates: HardwareRates, tables: Sequence[TableLoad], dense_flops: float,
                  intra_bytes: float, inter_bytes: float, collectives: int, host_tier: bool,
                  extra_bags: float = 0.0, routed: float = 0.0, replica_rows: float = 0.0) -> StepEstimate:
    """Price one rank's step: dense compute, the tables' lookups and optimizer updates,
    rows moved between tiers, and the bytes its collectives send over each link.

    Every part is paid in turn: on the machines this project targets the parts of a step
    are sequential except for what a prefetcher hides, which the estimate does not credit.
    ``extra_bags`` are the bags this rank pools beyond one per example and feature of its
    own batch (a row-wise shard pools every rank's examples); ``routed`` the examples times
    features whose ids a sharded step sends to their owners; ``replica_rows`` the row
    gradients data-parallel replicas apply, every rank's distinct ids of their tables.
    """
    device = sum(t.unique_rows * t.row_bytes * 2 + t.lookups * t.dim * 4 * 2 for t in tables)
    table_ops = sum(t.lookups * rates.lookup_op_s + t.unique_rows * rates.row_op_s for t in tables)
    h2d = sum(t.device_misses * t.row_bytes * 2 for t in tables) if host_tier else 0.0
    ssd_rows = sum(t.ssd_misses for t in tables)
    units = ssd_read_units(rates, tables)
    ssd_read = units * rates.ssd_read_unit
    # Every row read in evicts one, written to the log, which cleaning rewrites about once more.
    ssd_write = sum(t.ssd_misses * t.row_bytes for t in tables) * 1.5
    parts = {
        "overhead": rates.step_overhead_s,
        "dense": dense_flops / rates.dense_flops,
        "tables": table_ops + device / rates.device_bw + replica_rows * rates.replica_op_s,
        "host->device": h2d / rates.host_to_device_bw,
        "ssd": ssd_read_seconds(rates, units) + ssd_write / rates.ssd_write_bw,
        "comm": (intra_bytes / rates.intra_node_bw + inter_bytes / rates.inter_node_bw
                 + collectives * rates.collective_latency_s + max(extra_bags, 0.0) * rates.bag_op_s
                 + routed * rates.example_op_s),
    }
    links = {"device": device, "host->device": h2d, "ssd read": ssd_read, "ssd write": ssd_write,
             "intra-node": intra_bytes, "inter-node": inter_bytes}
    return StepEstimate(sum(parts.values()), parts, links, ssd_rows)


def ssd_read_units(rates: HardwareRates, tables: Sequence[TableLoad]) -> float:
    """Random reads (of ``rates.ssd_read_unit`` bytes) that the tables' SSD misses make."""
    rows = sum(t.ssd_misses for t in tables)
    # Rows read at random from files of F bytes in units of u bytes: the units touched,
    # W (1 - exp(-R / W)) with W = F / u, fewer than the rows when units hold several.
    windows = sum(t.ssd_file_bytes for t in tables) / rates.ssd_read_unit
    if windows >= 1 and rows:
        return min(rows, windows * -math.expm1(-rows / windows))
    return rows


def ssd_read_seconds(rates: HardwareRates, units: float) -> float:
    """The price of ``units`` random SSD reads: the drive's IOPS or its bandwidth, whichever binds."""
    return max(units / rates.ssd_read_iops, units * rates.ssd_read_unit / rates.ssd_read_bw)
