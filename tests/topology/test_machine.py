import json
from pathlib import Path

import pytest

from ctr_lightning.topology import Machine

MACHINES = Path(__file__).parent / "machines"


@pytest.mark.parametrize("name", ["dgx_a100", "cpu_2socket", "vm_1socket"])
def test_recorded_machines_load_and_round_trip(name, tmp_path):
    machine = Machine.load(MACHINES / f"{name}.json")
    machine.save(tmp_path / "m.json")
    assert Machine.load(tmp_path / "m.json") == machine
    assert machine.cpus and machine.memory_bytes > 0


def test_dgx_description_holds_what_its_documentation_says():
    m = Machine.load(MACHINES / "dgx_a100.json")
    assert len(m.numa_nodes) == 8 and len(m.cpus) == 256
    assert len(m.gpus) == 8 and m.nvlink_groups == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert sorted({g.numa_node for g in m.gpus}) == [1, 3, 5, 7]
    assert m.numa_node_of_cpu(176) == 3  # the second hardware thread of core 48
    assert sum(1 for n in m.nics if n.speed_mbps == 200_000) == 10


def test_unknown_stays_unknown_and_bad_files_are_named(tmp_path):
    vm = Machine.load(MACHINES / "vm_1socket.json")
    assert vm.nics[0].speed_mbps is None and vm.drives[0].numa_node is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match=r"bad.json: not a machine description"):
        Machine.load(bad)
    data = vm.to_json()
    del data["numa_nodes"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad.json: .*missing field.*numa_nodes"):
        Machine.load(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json: not JSON"):
        Machine.load(bad)
