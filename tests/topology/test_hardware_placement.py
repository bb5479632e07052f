import dataclasses

from ctr_lightning.topology import Machine, PlanOptions, plan

from .test_planner import MACHINES, check_capacities, dlrm_shape


def _shared_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_dgx_a100_ranks_sit_next_to_their_gpu_nic_and_drive():
    machine = Machine.load(MACHINES / "dgx_a100.json")
    shape = dlrm_shape([40_000_000, 3_000_000, 10_000, 500] * 6 + [40_000_000, 3_000_000])
    p = plan(machine, shape)
    assert p.world_size == 8 and p.accelerator == "gpu"
    assert [r.gpu for r in p.ranks] == list(range(8))
    cpus = [c for r in p.ranks for c in r.cpus]
    assert len(cpus) == len(set(cpus)) == 128  # disjoint: the four GPU nodes, 32 CPUs each
    for r in p.ranks:
        gpu = machine.gpus[r.gpu]
        assert r.numa_node == gpu.numa_node
        node_cpus = next(n.cpus for n in machine.numa_nodes if n.id == r.numa_node)
        assert set(r.cpus) <= set(node_cpus)
        assert any(c - 128 in r.cpus for c in r.cpus if c >= 128)  # whole cores: both threads of each
        nic = next(n for n in machine.nics if n.name == r.nic)
        assert nic.numa_node == gpu.numa_node and _shared_prefix(nic.pcie_path, gpu.pcie_path) >= 2  # its switch
        drive = next(d for d, fs in machine.file_systems() if r.ssd_dir.startswith(fs.mount_point + "/"))
        assert drive.numa_node == gpu.numa_node and _shared_prefix(drive.pcie_path, gpu.pcie_path) >= 2
    assert len({r.nic for r in p.ranks}) == 8  # one compute NIC per GPU
    assert len({r.ssd_dir for r in p.ranks}) == 4  # every data drive used
    assert p.intra_groups == ((0, 1, 2, 3, 4, 5, 6, 7),)
    check_capacities(p, machine)
    assert "estimated step" in p.to_text() and "mlx5_0" in p.to_text()


def test_two_socket_cpu_server_one_rank_per_socket():
    machine = Machine.load(MACHINES / "cpu_2socket.json")
    p = plan(machine, dlrm_shape([40_000_000, 3_000_000, 10_000, 500] * 6), options=PlanOptions(ranks_per_node=2))
    assert [r.numa_node for r in p.ranks] == [0, 1] and all(r.gpu is None for r in p.ranks)
    for r, node in zip(p.ranks, machine.numa_nodes):
        assert r.cpus == node.cpus
        assert next(n for n in machine.nics if n.name == r.nic).numa_node == node.id
        drive = max(((d, fs) for d, fs in machine.file_systems() if r.ssd_dir.startswith(fs.mount_point.rstrip("/") + "/")),
                    key=lambda x: len(x[1].mount_point))[0]
        assert drive.numa_node == node.id
        assert r.host_bytes == 0  # on a CPU the compute tier is DRAM already
    check_capacities(p, machine)


def test_nvlink_islands_size_the_kstep_groups():
    from ctr_lightning.topology.hardware_placement import nvlink_group_size

    dgx = Machine.load(MACHINES / "dgx_a100.json")
    assert nvlink_group_size(dgx, 8) == 8  # NVSwitch: one island, the whole node
    pairs = dataclasses.replace(dgx, nvlink_groups=((0, 1, 2, 3), (4, 5, 6, 7)))
    assert nvlink_group_size(pairs, 8) == 4
    assert nvlink_group_size(dataclasses.replace(dgx, nvlink_groups=((0, 2), (1, 3))), 4) == 4  # not contiguous
    assert nvlink_group_size(dataclasses.replace(dgx, nvlink_groups=((0,), (1,), (2,), (3,))), 4) == 4  # PCIe only
    assert nvlink_group_size(dataclasses.replace(dgx, nvlink_groups=None), 8) == 8  # unknown
    p = plan(pairs, dlrm_shape([1000] * 4))
    assert p.intra_groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_memory_limit_and_cpus_outside_the_process_are_respected():
    two = Machine.load(MACHINES / "cpu_2socket.json")
    limited = dataclasses.replace(two, memory_limit_bytes=64 << 30)
    p = plan(limited, dlrm_shape([1000]), options=PlanOptions(ranks_per_node=2, reserve_bytes=0))
    assert sum(r.device_bytes for r in p.ranks) <= 0.5 * (64 << 30) + 2  # half of the limit, over both nodes
    pinned = dataclasses.replace(two, allowed_cpus=tuple(range(32, 64)))  # a container on socket 1 only
    p = plan(pinned, dlrm_shape([1000]), options=PlanOptions(ranks_per_node=2))
    assert p.ranks[0].cpus == tuple(range(32, 64)) and p.ranks[1].cpus == tuple(range(32, 64))
