import os

from ctr_lightning.topology import Machine, discover


def test_discovers_this_machine(tmp_path):
    machine = discover()
    assert set(os.sched_getaffinity(0)) <= set(machine.cpus)
    assert machine.memory_bytes > 0 and 0 < machine.free_memory_bytes <= machine.memory_bytes
    # The file system holding the tests' temporary folder is found, writable, with its free space.
    st = os.statvfs(tmp_path)
    found = [fs for _, fs in machine.file_systems() if fs.total_bytes == st.f_blocks * st.f_frsize]
    assert found and all(fs.writable for fs in found)
    assert all(n.pcie_path and n.pci_address == n.pcie_path[-1] for n in machine.nics)
    machine.save(tmp_path / "here.json")
    assert Machine.load(tmp_path / "here.json") == machine


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_reads_a_recorded_two_socket_tree(tmp_path):
    """/sys and /proc as a 2-node machine shows them: an NVMe drive and a NIC on node 1."""
    sys, proc = tmp_path / "sys", tmp_path / "proc"
    for node, cpus in ((0, "0-3,8-11"), (1, "4-7,12-15")):
        _write(sys / f"devices/system/node/node{node}/cpulist", cpus + "\n")
        _write(sys / f"devices/system/node/node{node}/meminfo",
               f"Node {node} MemTotal:       8000000 kB\nNode {node} MemFree:        6000000 kB\n"
               f"Node {node} FilePages:      1000000 kB\nNode {node} Shmem:          0 kB\n")
    root = sys / "devices/pci0000:80/0000:80:01.0"
    nvme = root / "0000:81:00.0"
    nic = root / "0000:82:00.0"
    for device in (root, nvme, nic):
        _write(device / "numa_node", "1\n")
        (sys / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
        os.symlink(device, sys / "bus/pci/devices" / device.name)
    disk = nvme / "nvme/nvme0/nvme0n1"
    _write(disk / "size", str(2 * 10**9 // 512) + "\n")
    _write(disk / "queue/rotational", "0\n")
    _write(disk / "nvme0n1p1/partition", "1\n")
    (sys / "block").mkdir()
    os.symlink(disk, sys / "block/nvme0n1")
    os.symlink(sys / "devices/virtual/block/loop0", sys / "block/loop0")
    _write(nic / "net/ens5/speed", "25000\n")
    _write(nic / "net/ens5/operstate", "up\n")
    _write(nic / "net/ens6/speed", "100000\n")  # a faster port on the same card, with no link
    _write(nic / "net/ens6/operstate", "down\n")
    _write(sys / "devices/virtual/net/lo/speed", "-1\n")
    (sys / "class/net").mkdir(parents=True)
    os.symlink(nic / "net/ens5", sys / "class/net/ens5")
    os.symlink(nic / "net/ens6", sys / "class/net/ens6")
    os.symlink(sys / "devices/virtual/net/lo", sys / "class/net/lo")
    # A RAID-0 of the NVMe drive (md0), mounted at a path with a space; a FAT boot partition.
    _write(disk / "nvme0n1p2/partition", "2\n")
    md = sys / "devices/virtual/block/md0"
    (md / "slaves").mkdir(parents=True)
    os.symlink(disk / "nvme0n1p2", md / "slaves/nvme0n1p2")
    os.symlink(md, sys / "block/md0")
    _write(proc / "mounts", "sysfs /sys sysfs rw 0 0\n/dev/nvme0n1p1 /data ext4 rw,relatime 0 0\n"
                            "/dev/nvme0n1p1 /data ext4 rw,relatime 0 0\n/dev/nvme0n1p3 /boot/efi vfat rw 0 0\n"
                            "/dev/md0 /big\\040raid xfs rw 0 0\n")

    _write(disk / "nvme0n1p3/partition", "3\n")
    m = discover(sys, proc, gpus=False)
    assert [(n.id, n.cpus) for n in m.numa_nodes] == [(0, (0, 1, 2, 3, 8, 9, 10, 11)), (1, (4, 5, 6, 7, 12, 13, 14, 15))]
    assert m.numa_nodes[0].memory_bytes == 8000000 * 1024 and m.numa_nodes[0].free_bytes == 7000000 * 1024
    raid, drive = m.drives  # the loop device is not a drive
    assert (raid.name, raid.kind, raid.numa_node, raid.pcie_path) == ("md0", "raid", 1, ("0000:80:01.0", "0000:81:00.0"))
    assert [fs.mount_point for fs in raid.file_systems] == ["/big raid"]
    assert (drive.name, drive.kind, drive.numa_node, drive.rotational, drive.size_bytes) == (
        "nvme0n1", "nvme", 1, False, 2 * 10**9)
    assert drive.pcie_path == ("0000:80:01.0", "0000:81:00.0")
    # The FAT boot partition is no place for an SSD tier.
    assert [(fs.mount_point, fs.fstype, fs.writable) for fs in drive.file_systems] == [("/data", "ext4", True)]
    [nic_] = m.nics
    assert (nic_.name, nic_.numa_node, nic_.speed_mbps, nic_.pcie_path) == ("ens5", 1, 25000, ("0000:80:01.0", "0000:82:00.0"))
    assert m.gpus == ()


def test_memory_limit_is_the_smallest_on_the_processs_own_cgroup_path(tmp_path):
    sys, proc = tmp_path / "sys", tmp_path / "proc"
    _write(sys / "devices/system/node/node0/cpulist", "0-1\n")
    _write(sys / "devices/system/node/node0/meminfo", "Node 0 MemTotal:       8000000 kB\nNode 0 MemFree:  6000000 kB\n")
    # cgroup v2: no limit at the root, 8 GiB on the jobs slice, 4 GiB on this job, 2 GiB on a sibling.
    _write(sys / "fs/cgroup/memory.max", "max\n")
    _write(sys / "fs/cgroup/jobs/memory.max", f"{8 << 30}\n")
    _write(sys / "fs/cgroup/jobs/run1/memory.max", f"{4 << 30}\n")
    _write(sys / "fs/cgroup/jobs/run2/memory.max", f"{2 << 30}\n")
    _write(proc / "self/cgroup", "0::/jobs/run1\n")
    assert discover(sys, proc, gpus=False).memory_limit_bytes == 4 << 30
    # cgroup v1, the memory controller's own hierarchy; its unlimited value is a huge number.
    _write(sys / "fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    _write(sys / "fs/cgroup/memory/process_api/42/memory.limit_in_bytes", f"{3 << 30}\n")
    _write(proc / "self/cgroup", "7:cpu,cpuacct:/process_api/42\n5:memory:/process_api/42\n")
    assert discover(sys, proc, gpus=False).memory_limit_bytes == 3 << 30
    _write(proc / "self/cgroup", "5:memory:/\n")
    assert discover(sys, proc, gpus=False).memory_limit_bytes is None
