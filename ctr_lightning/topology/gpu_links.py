"""The GPU interconnect as ``nvidia-smi topo -m`` prints it: NVLink islands, GPU-NIC distances."""

from __future__ import annotations

import re
from dataclasses import dataclass

# nvidia-smi's legend, nearest first: same PCIe switch, several switches, one host bridge,
# one NUMA node's host bridges, across the socket interconnect.
PCIE_DISTANCE = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}


@dataclass(frozen=True)
class TopoMatrix:
    """What ``nvidia-smi topo -m`` says: per GPU pair and GPU-NIC pair the link
    (``NV12``, ``PIX``, ``SYS``...), and each GPU's CPU and NUMA affinity.

    Example::

        matrix = parse_topo_matrix(subprocess.check_output(["nvidia-smi", "topo", "-m"], text=True))
        matrix.nvlink_groups     # ((0, 1, 2, 3, 4, 5, 6, 7),) on a DGX A100
    """

    gpus: tuple[str, ...]
    nics: tuple[str, ...]
    links: dict[tuple[str, str], str]
    numa_affinity: dict[str, int | None]

    @property
    def nvlink_groups(self) -> tuple[tuple[int, ...], ...]:
        """Connected components of the GPUs under NVLink edges, singletons included."""
        parent = list(range(len(self.gpus)))

        def root(i: int) -> int:
            while parent[i] != i:
                i = parent[i]
            return i

        for i, a in enumerate(self.gpus):
            for j, b in enumerate(self.gpus):
                if i < j and self.links.get((a, b), "").startswith("NV"):
                    parent[root(j)] = root(i)
        groups: dict[int, list[int]] = {}
        for i in range(len(self.gpus)):
            groups.setdefault(root(i), []).append(i)
        return tuple(tuple(g) for g in sorted(groups.values()))

    def nic_distance(self, gpu: int, nic: str) -> int | None:
        return PCIE_DISTANCE.get(self.links.get((self.gpus[gpu], nic), ""))


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse the matrix part of ``nvidia-smi topo -m`` (the legend after it is ignored)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    header_at = next((i for i, line in enumerate(lines) if re.search(r"\bGPU0\b", line)), None)
    if header_at is None:
        raise ValueError("nvidia-smi topo -m: no header line with GPU0")
    columns = _cells(lines[header_at])
    links: dict[tuple[str, str], str] = {}
    numa: dict[str, int | None] = {}
    gpus: list[str] = []
    nics: list[str] = []
    for line in lines[header_at + 1:]:
        cells = _cells(line)
        name, values = cells[0], cells[1:]
        if name.startswith("Legend"):
            break
        if not re.match(r"^(GPU\d+|NIC\d+|mlx\w+)$", name):
            continue
        (gpus if name.startswith("GPU") else nics).append(name)
        for column, value in zip(columns, values):
            if column == "NUMA Affinity":
                numa[name] = int(value) if value.isdigit() else None
            elif column != "CPU Affinity":
                links[(name, column)] = value
    return TopoMatrix(tuple(gpus), tuple(nics), links, numa)


def visible_islands(groups: tuple[tuple[int, ...], ...], smi_bus_ids: list[str],
                    torch_bus_ids: list[str | None]) -> tuple[tuple[int, ...], ...] | None:
    """NVLink islands in torch's device numbering. ``nvidia-smi`` numbers every GPU of the
    machine in PCI order; torch sees only ``CUDA_VISIBLE_DEVICES``, in its own order. The
    PCI bus ids join the two; GPUs torch does not see drop out. None when a visible GPU's
    bus id is unknown on either side (then the islands cannot be told).

    Example::

        visible_islands(((0, 1), (2, 3)), ["0:07:00.0", "0:0f:00.0", "0:47:00.0", "0:4e:00.0"],
                        ["0:4e:00.0", "0:07:00.0"])     # ((0,), (1,)): torch's 0 is nvidia-smi's 3
    """
    smi = {_bus_id(b): i for i, b in enumerate(smi_bus_ids)}
    torch_index = {}
    for i, b in enumerate(torch_bus_ids):
        if b is None or _bus_id(b) not in smi:
            return None
        torch_index[smi[_bus_id(b)]] = i
    out = [tuple(sorted(torch_index[g] for g in group if g in torch_index)) for group in groups]
    return tuple(sorted(g for g in out if g))


def _bus_id(text: str) -> tuple[int, int, int, int]:
    """``00000000:07:00.0`` (nvidia-smi) and ``0000:07:00.0`` (torch) alike."""
    domain, bus, rest = text.strip().lower().split(":")
    device, function = rest.split(".")
    return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)


def _cells(line: str) -> list[str]:
    # Columns are tab-separated; a header's first cell is empty. Without tabs (copied
    # text), the two affinity headers are the only cells with a space inside.
    if "\t" in line:
        cells = [c.strip() for c in line.split("\t")]
        return cells[1:] if cells and cells[0] == "" else cells
    line = line.replace("CPU Affinity", "CPU_Affinity").replace("NUMA Affinity", "NUMA_Affinity")
    return [c.replace("_Affinity", " Affinity") for c in line.split()]
