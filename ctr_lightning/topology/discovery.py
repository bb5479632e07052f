"""Read this machine's topology from /sys and /proc (and ``nvidia-smi`` / torch for GPUs)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

from ctr_lightning.topology.gpu_links import parse_topo_matrix, visible_islands
from ctr_lightning.topology.machine import Drive, FileSystem, Gpu, Machine, Nic, NumaNode

_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,5}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$")  # 5 digits: VMD domains
_NOT_DRIVES = ("loop", "ram", "zram", "sr", "fd", "nbd")
_NVIDIA = "0x10de"


def discover(sys_root: str | os.PathLike = "/sys", proc_root: str | os.PathLike = "/proc",
             gpus: bool = True, gpu_memory_of: int | None = None) -> Machine:
    """This machine's :class:`Machine`: NUMA nodes, PCI GPUs / NICs / drives with their NUMA
    node and PCIe path, the file systems on each drive, NVLink islands.

    ``sys_root`` / ``proc_root`` read another tree (a recorded one); ``gpus=False`` skips
    torch and ``nvidia-smi``; ``gpu_memory_of`` asks only that GPU's free memory (each
    query makes a CUDA context on its GPU: a rank asks for its own). Whatever cannot be
    read is left unknown (``None``).

    Example::

        from ctr_lightning.topology import discover
        machine = discover()
        [n.cpus for n in machine.numa_nodes]   # [(0, 1)] on a 2-core VM
    """
    sys_root, proc_root = Path(sys_root), Path(proc_root)
    notes: list[str] = []
    numa = _numa_nodes(sys_root, proc_root)
    gpu_list, nvlink = _gpus(sys_root, notes, gpu_memory_of) if gpus else ((), None)
    live = sys_root == Path("/sys")
    return Machine(
        hostname=socket.gethostname() if live else sys_root.parent.name or "recorded",
        numa_nodes=numa,
        gpus=gpu_list,
        nics=_nics(sys_root),
        drives=_drives(sys_root, proc_root, statvfs=live),
        nvlink_groups=nvlink,
        memory_limit_bytes=_cgroup_memory_limit(sys_root, proc_root),
        allowed_cpus=tuple(sorted(os.sched_getaffinity(0))) if live else None,
        notes=tuple(notes),
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpulist(text: str) -> tuple[int, ...]:
    cpus: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return tuple(cpus)


def _meminfo(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        match = re.match(r"(?:Node \d+ )?(\w+):\s+(\d+)(?: kB)?", line)
        if match:
            out[match.group(1)] = int(match.group(2)) * (1024 if line.endswith("kB") else 1)
    return out


def _numa_nodes(sys_root: Path, proc_root: Path) -> tuple[NumaNode, ...]:
    base = sys_root / "devices/system/node"
    nodes = []
    for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = _cpulist(_read(d / "cpulist") or "")
        info = _meminfo(_read(d / "meminfo") or "")
        free = info.get("MemFree")
        if free is not None:  # page cache a node holds is free for the asking
            free += info.get("FilePages", 0) - info.get("Shmem", 0)
        nodes.append(NumaNode(int(d.name[4:]), cpus, info.get("MemTotal"), free))
    if nodes:
        return tuple(nodes)
    # No NUMA in the kernel: one node with every CPU and all memory.
    info = _meminfo(_read(proc_root / "meminfo") or "")
    online = _read(sys_root / "devices/system/cpu/online")
    cpus = _cpulist(online) if online else tuple(range(os.cpu_count() or 1))
    return (NumaNode(0, cpus, info.get("MemTotal"), info.get("MemAvailable")),)


def _pci_chain(sys_root: Path, device_path: Path) -> tuple[str, ...]:
    """The PCI addresses from the root port down to the device, from its sysfs path."""
    try:
        real = (sys_root / device_path.relative_to(sys_root)).resolve()
    except (OSError, ValueError):
        return ()
    return tuple(p for p in real.parts if _PCI_ADDRESS.match(p))


def _numa_of_pci(sys_root: Path, address: str | None) -> int | None:
    if address is None:
        return None
    value = _read(sys_root / "bus/pci/devices" / address / "numa_node")
    return int(value) if value is not None and int(value) >= 0 else None


def _nics(sys_root: Path) -> tuple[Nic, ...]:
    nics = []
    for d in sorted((sys_root / "class/net").glob("*")):
        chain = _pci_chain(sys_root, d)
        if not chain:  # lo, bridges, tunnels, ifb: not hardware
            continue
        if _read(d / "operstate") == "down":  # no link (cable out, port disabled): nothing to place ranks on
            continue
        speed = _read(d / "speed")
        nics.append(Nic(d.name, chain[-1], _numa_of_pci(sys_root, chain[-1]), chain,
                        int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None))
    return tuple(nics)


def _drives(sys_root: Path, proc_root: Path, statvfs: bool) -> tuple[Drive, ...]:
    mounts = _mounts_by_device(proc_root)
    drives = []
    for d in sorted((sys_root / "block").glob("*")):
        if d.name.startswith(_NOT_DRIVES):
            continue
        chain = _pci_chain(sys_root, d)
        numa = _numa_of_pci(sys_root, chain[-1] if chain else None)
        members = sorted((d / "slaves").glob("*"))
        if members and not chain:
            # RAID (md) or device-mapper: where its member devices sit, if they agree.
            chains = [_pci_chain(sys_root, m) for m in members]
            nodes = {_numa_of_pci(sys_root, c[-1] if c else None) for c in chains}
            chain = chains[0]
            numa = nodes.pop() if len(nodes) == 1 else None
        size = _read(d / "size")
        rotational = _read(d / "queue/rotational")
        names = [d.name] + sorted(p.name for p in d.glob(f"{d.name}*") if (p / "partition").exists())
        file_systems = tuple(fs for name in names for m in mounts.get(name, ())
                             if (fs := _file_system(m, statvfs)) is not None)
        drives.append(Drive(
            d.name, _drive_kind(d.name), chain[-1] if chain else None, numa, chain,
            int(size) * 512 if size and size.isdigit() else None,
            None if rotational is None else rotational == "1", file_systems))
    return tuple(drives)


def _drive_kind(name: str) -> str | None:
    for prefix, kind in (("nvme", "nvme"), ("vd", "virtio"), ("sd", "scsi"), ("xvd", "xen"), ("md", "raid"),
                         ("dm-", "device-mapper")):
        if name.startswith(prefix):
            return kind
    return None


def _mounts_by_device(proc_root: Path) -> dict[str, list[tuple[str, str, str]]]:
    out: dict[str, list[tuple[str, str, str]]] = {}
    seen: set[str] = set()
    for line in (_read(proc_root / "mounts") or "").splitlines():
        parts = line.split()
        if len(parts) < 4 or not parts[0].startswith("/dev/"):
            continue
        device, fstype, options = parts[0], parts[2], parts[3]
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])  # \040 is a space
        if mount_point in seen:
            continue
        seen.add(mount_point)
        out.setdefault(os.path.basename(device), []).append((mount_point, fstype, options))
    return out


def _file_system(mount: tuple[str, str, str], statvfs: bool) -> FileSystem | None:
    """The file system at a mount point; None for one that cannot hold an SSD tier's
    directory (a file bind-mounted into a container, a FAT boot partition)."""
    mount_point, fstype, options = mount
    if fstype in ("vfat", "msdos", "iso9660", "squashfs") or (statvfs and not os.path.isdir(mount_point)):
        return None
    total = free = None
    writable = "ro" not in options.split(",")
    if statvfs:
        try:
            st = os.statvfs(mount_point)
            total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
            writable = writable and os.access(mount_point, os.W_OK)
        except OSError:
            writable = False
    return FileSystem(mount_point, fstype, total, free, writable)


def _cgroup_memory_limit(sys_root: Path, proc_root: Path) -> int | None:
    """The smallest memory limit on the way from this process's own cgroup
    (``/proc/self/cgroup``) up to the hierarchy's root, cgroup v2 (``memory.max``) or v1
    (``memory.limit_in_bytes``): a job is often limited below the root, not at it."""
    places: list[tuple[Path, str, str]] = []  # (hierarchy root, limit file, the process's path in it)
    for line in (_read(proc_root / "self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":
            places.append((sys_root / "fs/cgroup", "memory.max", parts[2]))
        elif "memory" in parts[1].split(","):
            places.append((sys_root / "fs/cgroup/memory", "memory.limit_in_bytes", parts[2]))
    if not places:  # no process view (a recorded tree without one): the roots' limits
        places = [(sys_root / "fs/cgroup", "memory.max", "/"), (sys_root / "fs/cgroup/memory",
                                                                 "memory.limit_in_bytes", "/")]
    limits = []
    for root, name, path in places:
        steps = [p for p in path.strip("/").split("/") if p and p != ".."]
        for depth in range(len(steps) + 1):
            value = _read(root.joinpath(*steps[:depth]) / name)
            if value and value.isdigit() and int(value) < 1 << 60:  # "max" or v1's huge number: no limit
                limits.append(int(value))
    return min(limits) if limits else None


def _gpus(sys_root: Path, notes: list[str],
          memory_of: int | None) -> tuple[tuple[Gpu, ...], tuple[tuple[int, ...], ...] | None]:
    """GPUs from torch (memory) when CUDA is usable, else NVIDIA display controllers on PCI;
    NVLink islands from ``nvidia-smi topo -m``."""
    gpus: list[Gpu] = []
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            address = _torch_pci_address(props)
            free, total = torch.cuda.mem_get_info(i) if memory_of in (None, i) else (None, props.total_memory)
            chain = _pci_chain(sys_root, sys_root / "bus/pci/devices" / address) if address else ()
            gpus.append(Gpu(i, props.name, address, _numa_of_pci(sys_root, address), chain, total, free))
    else:
        pci = sorted(d for d in (sys_root / "bus/pci/devices").glob("*")
                     if _read(d / "vendor") == _NVIDIA and (_read(d / "class") or "").startswith("0x03"))
        for i, d in enumerate(pci):
            gpus.append(Gpu(i, None, d.name, _numa_of_pci(sys_root, d.name), _pci_chain(sys_root, d)))
        if gpus:
            notes.append("GPUs seen on PCI but CUDA is not usable here: their memory is unknown")
    if not gpus:
        return (), ()
    smi = shutil.which("nvidia-smi")
    if smi is None:
        notes.append("nvidia-smi not found: NVLink islands unknown")
        return tuple(gpus), None
    try:
        out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        notes.append(f"nvidia-smi topo -m failed ({err}): NVLink islands unknown")
        return tuple(gpus), None
    groups = parse_topo_matrix(out).nvlink_groups
    try:  # nvidia-smi numbers every GPU; torch only the visible ones, maybe in another order
        ids = subprocess.run([smi, "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        notes.append(f"nvidia-smi --query-gpu failed ({err}): NVLink islands unknown")
        return tuple(gpus), None
    islands = visible_islands(groups, ids, [g.pci_address for g in gpus])
    if islands is None:
        notes.append("GPUs' PCI bus ids unknown: NVLink islands cannot be matched to torch's devices")
    return tuple(gpus), islands


def _torch_pci_address(props: object) -> str | None:
    try:
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"  # type: ignore[attr-defined]
    except AttributeError:
        return None
