from pathlib import Path

import pytest

from ctr_lightning.topology import parse_topo_matrix

MACHINES = Path(__file__).parent / "machines"


def test_dgx_a100_is_one_nvlink_island_with_nics_per_gpu_pair():
    m = parse_topo_matrix((MACHINES / "dgx_a100_topo.txt").read_text())
    assert m.gpus == tuple(f"GPU{i}" for i in range(8)) and len(m.nics) == 10
    assert m.nvlink_groups == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert m.nic_distance(0, "mlx5_0") == 2 and m.nic_distance(0, "mlx5_2") == 5  # PXB, SYS
    assert [m.numa_affinity[g] for g in m.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]


def test_pcie_only_gpus_are_islands_of_one_and_copied_text_parses():
    m = parse_topo_matrix((MACHINES / "pcie_4gpu_topo.txt").read_text())
    assert m.nvlink_groups == ((0,), (1,), (2,), (3,))
    assert [m.numa_affinity[g] for g in m.gpus] == [0, 0, 1, 1]
    assert m.links[("GPU0", "GPU1")] == "PIX"


def test_pairs_joined_by_nvlink_bridges():
    text = ("\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tNV4\tSYS\tSYS\t0-7\t0\nGPU1\tNV4\t X \tSYS\tSYS\t0-7\t0\n"
            "GPU2\tSYS\tSYS\t X \tNV4\t8-15\t1\nGPU3\tSYS\tSYS\tNV4\t X \t8-15\t1\n")
    assert parse_topo_matrix(text).nvlink_groups == ((0, 1), (2, 3))
    with pytest.raises(ValueError, match="no header line with GPU0"):
        parse_topo_matrix("No devices were found\n")


def test_islands_follow_cuda_visible_devices_through_pci_bus_ids():
    from ctr_lightning.topology.gpu_links import visible_islands

    smi = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0"]
    pairs = ((0, 1), (2, 3))
    # CUDA_VISIBLE_DEVICES=3,0,1: torch's 0 is nvidia-smi's 3, torch's 1 and 2 its 0 and 1.
    assert visible_islands(pairs, smi, ["0000:4e:00.0", "0000:07:00.0", "0000:0f:00.0"]) == ((0,), (1, 2))
    assert visible_islands(pairs, smi, ["0000:07:00.0", "0000:0f:00.0", "0000:47:00.0", "0000:4e:00.0"]) == pairs
    assert visible_islands(pairs, smi, ["0000:07:00.0", None]) is None
    assert visible_islands(pairs, smi, ["0000:99:00.0"]) is None
