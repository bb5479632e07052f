import dataclasses
import math

import pytest

from ctr_lightning.topology import HardwareRates, Machine, PlanOptions, TableAccess, plan

from .test_planner import MACHINES, check_capacities, dlrm_shape


def test_two_dgx_nodes_with_kstep_send_less_across_nodes():
    machine = Machine.load(MACHINES / "dgx_a100.json")
    sizes = [40_000_000, 3_000_000, 10_000, 500] * 6 + [40_000_000, 3_000_000]
    sync = plan(machine, dlrm_shape(sizes), options=PlanOptions(num_nodes=2, sharding="row_wise"))
    kstep = plan(machine, dlrm_shape(sizes, k=16), options=PlanOptions(num_nodes=2, sharding="row_wise"))
    assert sync.world_size == 16 and [r.node for r in sync.ranks] == [0] * 8 + [1] * 8
    assert sync.step_estimate.link_bytes["inter-node"] > 0
    assert kstep.step_estimate.link_bytes["inter-node"] < sync.step_estimate.link_bytes["inter-node"]
    check_capacities(sync, machine)


def test_collectives_and_replica_rows_are_priced_once_per_kind_of_table():
    # Rates where only a collective's latency, or only a replica's row gradient, costs:
    # the estimate then counts them.
    vm = Machine.load(MACHINES / "vm_1socket.json")
    free = dataclasses.replace(
        HardwareRates.published("cpu"), device_bw=math.inf, host_to_device_bw=math.inf, intra_node_bw=math.inf,
        inter_node_bw=math.inf, dense_flops=math.inf, row_op_s=0.0, lookup_op_s=0.0, collective_latency_s=1.0)
    shape = dlrm_shape([1000, 1000], dim=16, batch=64)
    access = {t.name: TableAccess.zipf(t.num_embeddings, 1.0) for t in shape.tables}

    def comm(sharding, model=shape, rates=free):
        options = PlanOptions(ranks_per_node=2, sharding=sharding)
        return plan(vm, model, access, options, rates=rates).step_estimate

    # ids, lengths, pooled rows, their gradients (all-to-alls) and the dense all-reduce
    assert comm("row_wise").parts["comm"] == pytest.approx(5)
    # the replicas' counts, ids and row gradients (all-gathers), no all-to-all, the dense all-reduce
    assert comm("data_parallel").parts["comm"] == pytest.approx(4)
    assert comm({"t0": "row_wise", "t1": "data_parallel"}).parts["comm"] == pytest.approx(8)
    # k-step tables: one merge, the dense all-reduce
    assert comm("row_wise", dataclasses.replace(shape, sparse_sync="k_step")).parts["comm"] == pytest.approx(2)
    # A replica applies one row gradient a rank's distinct id, priced by replica_op_s alone.
    rows_only = dataclasses.replace(free, collective_latency_s=0.0, replica_op_s=1.0)
    replicated = comm({"t0": "row_wise", "t1": "data_parallel"}, rates=rows_only)
    assert replicated.parts["tables"] == pytest.approx(2 * access["t1"].unique(64))
    assert comm("row_wise", rates=rows_only).parts["tables"] == 0
