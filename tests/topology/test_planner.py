import dataclasses
from pathlib import Path

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import RowWiseAdagrad, SparseAdam, TieredEmbeddingBagCollection
from ctr_lightning.topology import Machine, ModelShape, PlanError, PlanOptions, TableAccess, plan
from ctr_lightning.topology.step_pricing import SSD_OVERHEAD

MACHINES = Path(__file__).parent / "machines"


def table_configs(sizes, dim=128):
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"])
            for i, n in enumerate(sizes)]


def dlrm_shape(sizes, dim=128, batch=2048, optimizer=RowWiseAdagrad(), k=1):
    return ModelShape.dlrm(table_configs(sizes, dim), optimizer, batch, 13, (512, 256), (1024, 1024, 512, 256, 1), k=k)


def check_capacities(p, machine):
    """Every rank's tables within its budgets, and the budgets within the machine's free memory."""
    for r in p.ranks:
        held = [t for t in p.tables if t.sharding.kind in ("row_wise", "data_parallel") or t.sharding.owner == r.rank]
        assert sum(t.device_rows * t.row_bytes for t in held) <= r.device_bytes
        assert sum(t.host_rows * t.row_bytes for t in held) <= r.host_bytes
        assert sum(t.ssd_rows * t.row_bytes for t in held) * SSD_OVERHEAD <= r.ssd_bytes
        if r.gpu is not None:
            assert r.device_bytes <= machine.gpus[r.gpu].free_bytes
    for node in machine.numa_nodes:
        dram = [r.host_bytes if r.gpu is not None else r.device_bytes for r in p.ranks
                if r.numa_node == node.id and r.node == 0]
        assert sum(dram) <= node.free_bytes
    for t in p.tables:
        per_rank = -(-t.rows // (p.world_size if t.sharding.kind == "row_wise" else 1))
        assert t.device_rows + t.host_rows + t.ssd_rows == per_rank


def test_vm_plan_drives_a_real_collection(tmp_path):
    """The plan's sharding and storage build a working TieredEmbeddingBagCollection."""
    machine = Machine.load(MACHINES / "vm_1socket.json")
    shape = ModelShape.dlrm(table_configs([2000, 500], dim=8), SparseAdam(), 64, 13, (16,), (16, 1))
    p = plan(machine, shape, options=PlanOptions(device_bytes=2000 * 40, ssd_dirs=(str(tmp_path),)))
    assert p.ranks[0].cpus == (0, 1) and p.ranks[0].ssd_dir == str(tmp_path)
    check_capacities(p, machine)
    assert sum(t.ssd_rows for t in p.tables) > 0  # the budget holds 2,000 of 2,500 rows
    ebc = TieredEmbeddingBagCollection(table_configs([2000, 500], dim=8), storage=p.storage(0), sharding=p.sharding())
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.arange(400) % 2500, torch.ones(400, dtype=torch.int32))
    out = ebc(kjt)
    assert out.values().shape == (200, 16)


def test_skew_aware_split_serves_more_lookups_from_dram():
    machine = Machine.load(MACHINES / "vm_1socket.json")
    shape = dlrm_shape([1_000_000, 1_000_000], dim=64, batch=4096, optimizer=SparseAdam())
    access = {"t0": TableAccess.zipf(1_000_000, 1.2), "t1": TableAccess.zipf(1_000_000, 0.3)}
    budget = 600_000 * 768  # 30% of the rows
    options = PlanOptions(device_bytes=budget, ssd_dirs=("/",))
    aware = plan(machine, shape, access, options)
    uniform = plan(machine, shape, access, dataclasses.replace(options, skew_aware=False))
    u0, u1 = (t.device_rows for t in uniform.tables)
    assert abs(u0 - u1) < 0.05 * u0  # by size, beyond each table's batches in flight
    # Each byte goes where it serves the most lookups: the flat table's rows stay worth
    # more for longer, the hot table's 30k hottest rows already serve 94% of its lookups.
    hot, flat = aware.tables
    assert hot.device_coverage > 0.9 and hot.device_rows < flat.device_rows
    assert access["t0"].probs[access["t0"].ids.cumsum() > hot.device_rows][0] == pytest.approx(
        access["t1"].probs[access["t1"].ids.cumsum() > flat.device_rows][0], rel=0.05)
    served = [sum(t.device_coverage for t in p.tables) for p in (aware, uniform)]
    assert served[0] > served[1]
    assert aware.step_estimate.seconds < uniform.step_estimate.seconds
    check_capacities(aware, machine)


def test_plans_that_cannot_fit_are_refused_with_their_numbers():
    dgx = Machine.load(MACHINES / "dgx_a100.json")
    vm = Machine.load(MACHINES / "vm_1socket.json")
    with pytest.raises(PlanError, match=r"rank 0: its tables hold .* GiB.* has .* GiB for this rank"):
        plan(vm, dlrm_shape([10**9]))
    with pytest.raises(PlanError, match=r"16 ranks per node but the machine has 8 GPU"):
        plan(dgx, dlrm_shape([1000]), options=PlanOptions(ranks_per_node=16))
    with pytest.raises(PlanError, match="no GPU"):
        plan(vm, dlrm_shape([1000]), options=PlanOptions(accelerator="gpu"))
    read_only = dataclasses.replace(vm, drives=tuple(
        dataclasses.replace(d, file_systems=tuple(dataclasses.replace(fs, writable=False) for fs in d.file_systems))
        for d in vm.drives))
    with pytest.raises(PlanError, match=r"do not fit in the memory tiers and no writable SSD directory"):
        plan(read_only, dlrm_shape([200_000_000]))
    with pytest.raises(PlanError, match=r"ssd_dir '/x': file system / is not writable"):
        plan(read_only, dlrm_shape([1000]), options=PlanOptions(ssd_dirs=("/x",)))


def test_a_budget_below_the_batches_in_flight_is_refused():
    vm = Machine.load(MACHINES / "vm_1socket.json")
    shape = dlrm_shape([1_000_000, 1_000_000], dim=64, batch=4096, optimizer=SparseAdam())
    with pytest.raises(PlanError, match=r"smaller than the rows the batches in flight touch .* 2 batches of 4096"):
        plan(vm, shape, options=PlanOptions(device_bytes=1000 * 768, ssd_dirs=("/",)))
    for skew_aware in (True, False):  # just above: each table gets at least its batches' rows
        p = plan(vm, shape, options=PlanOptions(device_bytes=20_000 * 768, ssd_dirs=("/",), skew_aware=skew_aware))
        assert all(t.device_rows >= 2 * 2400 for t in p.tables)


def test_torchrec_constraints_and_topology():
    from torchrec.distributed.planner.types import ParameterConstraints

    dgx = Machine.load(MACHINES / "dgx_a100.json")
    shape = dlrm_shape([40_000_000, 3_000_000, 10_000, 500])
    constraints = {"t0": ParameterConstraints(sharding_types=["row_wise"], pooling_factors=[3.0, 5.0]),
                   "t2": ParameterConstraints(sharding_types=["table_wise", "data_parallel"])}
    p = plan(dgx, shape, options=PlanOptions(constraints=constraints))
    assert p.sharding()["t0"] == "row_wise" and p.sharding()["t2"] in ("table_wise", "data_parallel")
    with pytest.raises(PlanError, match=r"table 't1': sharding types \['column_wise'\] are not among"):
        plan(dgx, shape, options=PlanOptions(constraints={"t1": ParameterConstraints(sharding_types=["column_wise"])}))
    topology = p.torchrec_topology()  # torchrec's planner can take the same cluster
    assert topology.world_size == 8 and topology.local_world_size == 8 and topology.compute_device == "cuda"
    assert topology.devices[0].storage.hbm == p.ranks[0].device_bytes
    assert topology.devices[0].storage.ddr == p.ranks[0].host_bytes
    assert topology.intra_host_bw == pytest.approx(p.rates.intra_node_bw / 1000)


def test_small_hot_tables_get_a_replica_on_every_rank_where_that_is_cheaper():
    server = Machine.load(MACHINES / "cpu_2socket.json")
    shape = dlrm_shape([40_000_000, 40_000_000] + [200] * 12, dim=64)
    large = {"t0": "row_wise", "t1": "row_wise"}
    small = [f"t{i}" for i in range(2, 14)]
    options = PlanOptions(ranks_per_node=2, sharding={**large, **{t: "auto" for t in small}})
    auto = plan(server, shape, options=options)
    assert {auto.sharding()[t] for t in small} == {"data_parallel"}
    check_capacities(auto, server)
    assert "data_parallel" in auto.to_text()
    # Against the small tables whole on one rank each: fewer bytes and a shorter step,
    # although no single table moved alone pays for the replicas' collectives.
    owned = plan(server, shape, options=dataclasses.replace(options, sharding={**large, **{t: "table_wise" for t in small}}))
    assert sum(auto.step_estimate.link_bytes.values()) < sum(owned.step_estimate.link_bytes.values())
    assert auto.step_estimate.seconds < owned.step_estimate.seconds
    # Under k-step table sync every rank trains replicas already: no data-parallel tables.
    kstep = dataclasses.replace(shape, sparse_sync="k_step")
    assert "data_parallel" not in plan(server, kstep, options=options).sharding().values()
    # A replica must fit every rank: a table too large for that is never replicated.
    vm = Machine.load(MACHINES / "vm_1socket.json")
    two = plan(vm, dlrm_shape([3_000_000, 1000], dim=64), options=PlanOptions(ranks_per_node=2))
    assert two.sharding()["t0"] != "data_parallel"
    check_capacities(two, vm)


def test_gpu_plan_with_tables_in_and_beyond_hbm_builds_a_collection(tmp_path):
    """Tables that fit the device tier and tables that spill share one SSD directory: all
    get a host tier, which TableSetup requires of tables sharing an SSD directory."""
    dgx = Machine.load(MACHINES / "dgx_a100.json")
    dgx = dataclasses.replace(dgx, drives=tuple(dataclasses.replace(d, file_systems=tuple(
        dataclasses.replace(fs, writable=True) for fs in d.file_systems)) for d in dgx.drives))
    shape = dlrm_shape([400_000, 500], dim=16)
    p = plan(dgx, shape, options=PlanOptions(ranks_per_node=1, device_bytes=100_000 * 68, host_bytes=150_000 * 68,
                                             ssd_dirs=(str(tmp_path),)))
    big, small = p.tables
    assert big.host_rows > 0 and big.ssd_rows > 0 and small.host_rows == 0 and small.ssd_rows == 0
    storage = p.storage(0)
    assert storage["t1"].host_rows == 1 and storage["t0"].host_rows == big.host_rows
    TieredEmbeddingBagCollection(table_configs([400_000, 500], dim=16), optimizer=RowWiseAdagrad(), storage=storage)
