"""What one machine has: NUMA nodes, GPUs, NICs, drives and their file systems, as typed
values that save to and load from JSON. ``None`` always means unknown, never a guess."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

FORMAT = "ctr-lightning-machine-1"


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its CPUs and memory (``memory_bytes`` total, ``free_bytes`` available)."""

    id: int
    cpus: tuple[int, ...]
    memory_bytes: int | None = None
    free_bytes: int | None = None


@dataclass(frozen=True)
class Gpu:
    """One GPU, with the NUMA node and PCIe path (root port first) it hangs off."""

    index: int
    name: str | None = None
    pci_address: str | None = None
    numa_node: int | None = None
    pcie_path: tuple[str, ...] = ()
    memory_bytes: int | None = None
    free_bytes: int | None = None


@dataclass(frozen=True)
class Nic:
    """One physical network interface; ``speed_mbps`` as the link reports it."""

    name: str
    pci_address: str | None = None
    numa_node: int | None = None
    pcie_path: tuple[str, ...] = ()
    speed_mbps: int | None = None


@dataclass(frozen=True)
class FileSystem:
    """A file system mounted from a drive, with its capacity and free space."""

    mount_point: str
    fstype: str
    total_bytes: int | None = None
    free_bytes: int | None = None
    writable: bool = False


@dataclass(frozen=True)
class Drive:
    """One block device (``kind``: ``nvme``, ``virtio``, ``scsi`` or ``None``) and what is mounted from it."""

    name: str
    kind: str | None = None
    pci_address: str | None = None
    numa_node: int | None = None
    pcie_path: tuple[str, ...] = ()
    size_bytes: int | None = None
    rotational: bool | None = None
    file_systems: tuple[FileSystem, ...] = ()


@dataclass(frozen=True)
class Machine:
    """One node of a cluster as :func:`~ctr_lightning.topology.discover` reads it.

    ``nvlink_groups`` are the islands of GPU indices joined by NVLink (``()``: none;
    ``None``: not known, for example without ``nvidia-smi``). ``memory_limit_bytes`` is a
    cgroup's limit below the physical memory, when there is one.

    Example::

        machine = discover()
        machine.save("node.json")
        Machine.load("node.json") == machine    # True
        machine.numa_node_of_cpu(0)             # 0
    """

    hostname: str
    numa_nodes: tuple[NumaNode, ...]
    gpus: tuple[Gpu, ...] = ()
    nics: tuple[Nic, ...] = ()
    drives: tuple[Drive, ...] = ()
    nvlink_groups: tuple[tuple[int, ...], ...] | None = None
    memory_limit_bytes: int | None = None
    allowed_cpus: tuple[int, ...] | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def cpus(self) -> tuple[int, ...]:
        everything = tuple(c for node in self.numa_nodes for c in node.cpus)
        if self.allowed_cpus is None:
            return everything
        allowed = set(self.allowed_cpus)
        return tuple(c for c in everything if c in allowed)

    @property
    def memory_bytes(self) -> int | None:
        return _known_sum(n.memory_bytes for n in self.numa_nodes)

    @property
    def free_memory_bytes(self) -> int | None:
        free = _known_sum(n.free_bytes for n in self.numa_nodes)
        if free is not None and self.memory_limit_bytes is not None:
            free = min(free, self.memory_limit_bytes)
        return free

    def numa_node_of_cpu(self, cpu: int) -> int | None:
        return next((n.id for n in self.numa_nodes if cpu in n.cpus), None)

    def file_systems(self) -> list[tuple[Drive, FileSystem]]:
        return [(d, fs) for d in self.drives for fs in d.file_systems]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Machine:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a machine description of format {FORMAT!r}: format {data.get('format')!r}")
        try:
            return Machine(
                hostname=data["hostname"],
                numa_nodes=tuple(NumaNode(**{**n, "cpus": tuple(n["cpus"])}) for n in data["numa_nodes"]),
                gpus=tuple(Gpu(**{**g, "pcie_path": tuple(g.get("pcie_path", ()))}) for g in data.get("gpus", ())),
                nics=tuple(Nic(**{**n, "pcie_path": tuple(n.get("pcie_path", ()))}) for n in data.get("nics", ())),
                drives=tuple(_drive(d) for d in data.get("drives", ())),
                nvlink_groups=(None if data.get("nvlink_groups") is None
                               else tuple(tuple(g) for g in data["nvlink_groups"])),
                memory_limit_bytes=data.get("memory_limit_bytes"),
                allowed_cpus=None if data.get("allowed_cpus") is None else tuple(data["allowed_cpus"]),
                notes=tuple(data.get("notes", ())),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"machine description: bad or missing field ({err})") from err

    def save(self, path: str | os.PathLike) -> None:
        text = json.dumps(self.to_json(), indent=1)
        # Lists of numbers (CPUs, islands) on one line each: a 256-CPU node stays readable.
        text = re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
        with open(path, "w") as f:
            f.write(text + "\n")

    @staticmethod
    def load(path: str | os.PathLike) -> Machine:
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err})") from err
        try:
            return Machine.from_json(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err


def _drive(d: dict[str, Any]) -> Drive:
    return Drive(**{**d, "pcie_path": tuple(d.get("pcie_path", ())),
                    "file_systems": tuple(FileSystem(**fs) for fs in d.get("file_systems", ()))})


def _known_sum(values: Any) -> int | None:
    values = list(values)
    if not values or any(v is None for v in values):
        return None
    return sum(values)
