import dataclasses
import math
from pathlib import Path

import pytest

from ctr_lightning.topology import HardwareRates, Machine
from ctr_lightning.topology.cost_model import TableLoad, estimate_step, ssd_read_seconds

MACHINES = Path(__file__).parent / "machines"


def _load(misses, file_bytes):
    return TableLoad("t", lookups=4096, unique_rows=3000, device_misses=misses, ssd_misses=misses, row_bytes=384,
                     dim=32, ssd_file_bytes=file_bytes)


def test_estimate_parts_add_up_and_reads_share_units():
    rates = dataclasses.replace(HardwareRates.published("cpu"), ssd_read_iops=1e4, ssd_read_bw=1e30,
                                ssd_write_bw=1e30, ssd_read_unit=128 << 10)
    sparse = estimate_step(rates, [_load(100, 10 << 30)], 1e9, 1e6, 0, 5, host_tier=False)
    assert sparse.seconds == pytest.approx(sum(sparse.parts.values()))
    assert sparse.ssd_rows == 100 and sparse.parts["ssd"] == pytest.approx(100 / 1e4, rel=1e-3)  # far apart
    dense = estimate_step(rates, [_load(10_000, 64 << 20)], 1e9, 1e6, 0, 5, host_tier=False)
    units = 512 * -math.expm1(-10_000 / 512)  # 512 units of 128 KiB, nearly all touched
    assert dense.parts["ssd"] == pytest.approx(units / 1e4, rel=1e-6)
    assert dense.link_bytes["ssd read"] == pytest.approx(units * (128 << 10))



def test_an_ssd_read_costs_the_slower_of_its_iops_and_its_bytes():
    rates = dataclasses.replace(HardwareRates.published("cpu"), ssd_read_iops=1e4, ssd_read_bw=1e9, ssd_read_unit=4096)
    assert ssd_read_seconds(rates, 100) == pytest.approx(100 / 1e4)  # 4 KiB reads: the IOPS bind
    large = dataclasses.replace(rates, ssd_read_unit=1 << 20)
    assert ssd_read_seconds(large, 100) == pytest.approx(100 * (1 << 20) / 1e9)  # 1 MiB reads: the bandwidth


def test_published_rates_follow_the_machine():
    dgx = Machine.load(MACHINES / "dgx_a100.json")
    assert HardwareRates.for_machine(dgx, dgx.gpus[0]).name == "a100-80gb"
    forty = dataclasses.replace(dgx.gpus[0], name="NVIDIA A100-SXM4-40GB", memory_bytes=40 << 30)
    assert HardwareRates.for_machine(dgx, forty).name == "a100"
    other = dataclasses.replace(dgx.gpus[0], name="Tesla V100-SXM2-32GB")
    assert "standing in for 'Tesla V100-SXM2-32GB'" in HardwareRates.for_machine(dgx, other).name
    one, many = (HardwareRates.for_machine(dgx, None, cpus=n) for n in (1, 32))
    assert many.dense_flops == 32 * one.dense_flops and many.row_op_s == one.row_op_s / 32
    assert HardwareRates.for_machine(dgx, None, nic_mbps=200_000).inter_node_bw == 25e9
    with pytest.raises(ValueError, match="no published rates for 'tpu'"):
        HardwareRates.published("tpu")
