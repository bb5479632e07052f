import dataclasses
import math
import warnings

import numpy as np
import pytest
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding import SparseAdam
from ctr_lightning.topology import HardwareRates, ModelShape
from ctr_lightning.topology.calibration import (INF, LinkSamples, RateSamples, _windows, fit_links, fit_rates,
                                                measure_rates, zipf_ids)


def test_read_unit_is_recovered_from_two_densities():
    w, c = 5000.0, 80e-6
    cost = lambda r: c * w * -math.expm1(-r / w)  # noqa: E731
    assert _windows(cost(3000), 3000, cost(800), 800) == pytest.approx(w, rel=1e-6)
    assert _windows(3000 * c, 3000, 800 * c, 800) is None  # every read costs the same: no shared units


def test_zipf_ids_are_skewed_and_in_range():
    rng = np.random.default_rng(0)
    ids = zipf_ids(rng, 1000, 20_000, 1.2)
    assert ids.min() >= 0 and ids.max() < 1000
    _, counts = np.unique(ids, return_counts=True)
    assert np.sort(counts)[-10:].sum() > 0.3 * len(ids)
    assert len(np.unique(zipf_ids(rng, 1000, 20_000, 0.0))) > 990


def small_shape() -> ModelShape:
    """The shape the recorded samples below were measured on: 2 tables of 3000 rows, dim 8, batch 256."""
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=3000, feature_names=[f"f{i}"])
              for i in range(2)]
    return ModelShape.dlrm(tables, SparseAdam(), 256, 13, (16,), (16, 1))


# Chosen rates: a step costs FIXED + ROW * distinct rows in memory, and C * W * (1 - exp(-reads / W))
# more for the SSD rows it reads, W windows of the files each read at C seconds.
FIXED, ROW, C, W = 2e-3, 3e-7, 80e-6, 5000.0


def step_seconds(rows: float, reads: float = 0.0) -> float:
    return FIXED + ROW * rows + C * W * -math.expm1(-reads / W)


def test_fit_rates_recovers_chosen_rates():
    shape = small_shape()
    file_bytes = int(W * 8192.5)  # 8192.5 bytes a window: the unit, truncated to whole bytes, is 8192
    # Per density, three steps whose reads and costs rise together: the medians are the middle step's.
    uniform = tuple((step_seconds(u, r), u, r) for u, r in ((495.0, 2990.0), (480.0, 3000.0), (500.0, 3010.0)))
    hot = tuple((step_seconds(u, r), u, r) for u, r in ((160.0, 1190.0), (170.0, 1200.0), (165.0, 1210.0)))
    in_memory = tuple((step_seconds(u), u) for u in (150.0, 270.0, 400.0, 490.0))
    samples = RateSamples(threads=2, lookups=512, steps=in_memory,
                          ssd_steps=(uniform, hot), ssd_file_bytes=file_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # over 512 rows read a step at both densities: no warning
        rates = fit_rates(shape, samples)
    assert rates.row_op_s == pytest.approx(ROW, rel=1e-6)
    assert rates.dense_flops == pytest.approx(shape.dense_flops_per_example * 256 / FIXED, rel=1e-6)
    # A window read costs C: 1 / C reads a second, whatever the density.
    assert rates.ssd_read_iops == pytest.approx(1 / C, rel=1e-6)
    assert rates.ssd_read_unit == 8192
    assert rates.name == "measured here (2 threads)" and rates.lookup_op_s == 0.0
    assert rates.device_bw == rates.host_to_device_bw == rates.ssd_read_bw == rates.ssd_write_bw == INF


def test_fit_rates_clamps_and_prices_reads_that_cost_alike():
    shape = small_shape()
    base = HardwareRates.published("cpu")
    rows = (150.0, 270.0, 400.0, 490.0)
    # Steps faster with more rows (noise): no negative row cost, the line's intercept stays the fixed cost.
    falling = fit_rates(shape, RateSamples(1, 512, tuple((5e-3 - 1e-7 * u, u) for u in rows)))
    assert falling.row_op_s == 0.0
    assert falling.dense_flops == pytest.approx(shape.dense_flops_per_example * 256 / 5e-3, rel=1e-6)
    assert falling.ssd_read_iops == base.ssd_read_iops and falling.name == "measured here (1 thread)"
    # A line through a negative intercept: the fixed cost is 1 microsecond, not below.
    steep = fit_rates(shape, RateSamples(1, 512, tuple((-1e-3 + 1e-5 * u, u) for u in rows)))
    assert steep.row_op_s == pytest.approx(1e-5, rel=1e-6)
    assert steep.dense_flops == pytest.approx(shape.dense_flops_per_example * 256 / 1e-6, rel=1e-6)
    # Every read costs C whatever the density (C * reads): no windows fit, a read brings in a page.
    alike = tuple(tuple((FIXED + ROW * u + C * r, u, r) for u in (200.0, 210.0, 220.0)) for r in (3000.0, 1200.0))
    flat = fit_rates(shape, RateSamples(1, 512, tuple((step_seconds(u), u) for u in rows), alike, 10 << 20))
    assert flat.ssd_read_iops == pytest.approx(1 / C, rel=1e-6) and flat.ssd_read_unit == 4096


# Recorded on this project's 2 shared cores, 2026-12-06: sample_rates(small_shape(), threads=1,
# ssd_dir=<tmp>, rows=3000, steps=2) (what measure_rates times before it fits).
RECORDED = RateSamples(
    threads=1, lookups=512,
    steps=((0.001166564499726519, 153.0), (0.001254760500160046, 271.5), (0.0012038499999107444, 403.0),
           (0.001236723999681999, 492.0)),
    ssd_steps=(((0.0036325810015114257, 499.0, 332.0), (0.0034202150000055553, 487.0, 356.0)),
               ((0.003670657000839128, 162.0, 48.0), (0.0034708809998846846, 165.0, 46.0))),
    ssd_file_bytes=769668)


def test_fit_rates_on_a_recorded_machine():
    shape = small_shape()
    with pytest.warns(UserWarning, match="SSD calibration: 47 rows read a step"):
        rates = fit_rates(shape, RECORDED)
    # Least squares by the normal equations over the 4 (rows, seconds) points.
    t = [s for s, _ in RECORDED.steps]
    u = [r for _, r in RECORDED.steps]
    n = len(t)
    slope = (n * sum(a * b for a, b in zip(u, t)) - sum(u) * sum(t)) / (n * sum(a * a for a in u) - sum(u) ** 2)
    fixed = (sum(t) - slope * sum(u)) / n
    assert slope > 0 and fixed > 1e-6  # neither clamp applies here
    assert rates.row_op_s == pytest.approx(slope, rel=1e-6)
    assert rates.dense_flops == pytest.approx(shape.dense_flops_per_example * 256 / fixed, rel=1e-6)
    # The SSD's cost a step: beyond the line, the median (of 2 steps: their mean) at each density.
    (t1, r1), (t2, r2) = [(sum(s - fixed - slope * rows for s, rows, _ in d) / 2, sum(r for _, _, r in d) / 2)
                          for d in RECORDED.ssd_steps]
    assert (r1, r2) == (344.0, 47.0)
    # The hot head's 47 reads cost more than the uniform 344: no window count explains it
    # (the ratio of costs must lie between 1 and r1 / r2), so a read is a page and all count.
    assert t1 / t2 < 1
    assert rates.ssd_read_unit == 4096
    assert rates.ssd_read_iops == pytest.approx(r1 / t1, rel=1e-6)
    # The same, as numbers: 0.135 us a row, 0.74 GFLOP/s, 150k reads a second.
    assert (rates.row_op_s, rates.dense_flops, rates.ssd_read_iops) == pytest.approx((1.3498e-7, 7.3983e8, 1.5029e5),
                                                                                     rel=1e-4)


def test_measure_rates_on_this_machine(tmp_path):
    shape = small_shape()
    # So small a batch reads too few rows a step for the tier's parallel reads, and says so.
    with pytest.warns(UserWarning, match="SSD calibration: .* rows read a step"):
        rates = measure_rates(shape, threads=1, ssd_dir=str(tmp_path), rows=3000, steps=2)
    assert 0 < rates.dense_flops < 1e13 and rates.row_op_s >= 0
    assert rates.ssd_read_iops > 0 and rates.ssd_read_unit >= 4096
    assert list(tmp_path.iterdir()) == []  # its SSD files are gone


# Chosen link rates, for 2 ranks of the 2-table, dim-8 shape at 64 examples.
BW, A2A_LATENCY, LATENCY, EXAMPLE, BAG, REPLICA = 2e9, 30e-6, 80e-6, 3e-7, 1e-7, 4e-7


def link_samples(rates: HardwareRates) -> LinkSamples:
    """Timings built from the chosen rates as their definitions say a step pays them."""
    world, b, features, dim = 2, 64, 2, 8
    half = (world - 1) / world  # the share of a rank's data that goes to the other rank
    small, large = 4096 * half, (1 << 23) * half
    local = {("local", 16): 1.0e-3, ("local", b): 1.6e-3}
    ids = b * features * 8 * half  # int64 ids to their owners
    # Table-wise: 5 collectives, ids out, pooled rows out and their gradients back, EXAMPLE per example and feature.
    table_wise = (local["local", b] + 5 * LATENCY + (ids + b * features * dim * 4 * 2 * half) / BW
                  + EXAMPLE * b * features)
    # Row-wise: the same routing, but every rank's partial sums of every example (both ways),
    # and BAG per bag pooled for the other rank's examples.
    row_wise = (local["local", b] + 5 * LATENCY + (ids + 2 * (world - 1) * b * features * dim * 4) / BW
                + EXAMPLE * b * features + BAG * (world - 1) * b * features)
    local_rows = {16: 31.0, b: 112.0}
    replica_rows = {16: (30.0, 58.0), b: (110.0, 200.0)}  # a rank's distinct rows, both ranks' together

    def data_parallel(n: int) -> float:
        own, union = replica_rows[n]
        applied = world * own  # row gradients a replica applies
        # Whatever the size (latency, ...), ids and gradient rows to the other rank, the extra
        # distinct rows stepped, a lookup's and a row's reads for every gradient applied, and REPLICA each.
        return (local["local", n] + 5 * LATENCY + 1e-4 + (world - 1) * own * (8 + dim * 4) / BW
                + rates.row_op_s * (union - local_rows[n])
                + applied * (rates.lookup_op_s + dim * 4 * 2 / rates.device_bw) + REPLICA * applied)

    seconds = {**local, ("row_wise", 16): local["local", 16] + 5 * LATENCY, ("row_wise", b): row_wise,
               ("table_wise", b): table_wise, ("data_parallel", 16): data_parallel(16),
               ("data_parallel", b): data_parallel(b)}
    return LinkSamples(world=world, examples=b,
                       all_to_all=((small, A2A_LATENCY + small / BW), (large, A2A_LATENCY + large / BW)),
                       seconds=seconds, local_rows=local_rows, replica_rows=replica_rows)


def link_shape() -> ModelShape:
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10_000, feature_names=[f"f{i}"])
              for i in range(2)]
    return ModelShape.dlrm(tables, SparseAdam(), 64, 13, (16,), (16, 1))


def test_fit_links_recovers_chosen_rates():
    rates = dataclasses.replace(HardwareRates.published("cpu"), row_op_s=2e-7, lookup_op_s=5e-8, device_bw=20e9)
    links = fit_links(rates, link_shape(), link_samples(rates))
    assert links.intra_node_bw == pytest.approx(BW, rel=1e-6)
    assert links.collective_latency_s == pytest.approx(LATENCY, rel=1e-6)
    assert links.example_op_s == pytest.approx(EXAMPLE, rel=1e-6)
    assert links.bag_op_s == pytest.approx(BAG, rel=1e-6)
    assert links.replica_op_s == pytest.approx(REPLICA, rel=1e-6)
    # What the links do not measure is left as it was.
    unmeasured = dataclasses.replace(links, intra_node_bw=rates.intra_node_bw,
                                     collective_latency_s=rates.collective_latency_s,
                                     example_op_s=0.0, bag_op_s=0.0, replica_op_s=0.0)
    assert unmeasured == rates


def test_fit_links_clamps_noise():
    rates = HardwareRates.published("cpu")
    samples = link_samples(rates)
    # Every run as fast as the rank alone, and the large all-to-all no slower than the small one.
    (small, t), (large, _) = samples.all_to_all
    flat = dataclasses.replace(samples, all_to_all=((small, t), (large, t)),
                               seconds={(name, n): samples.seconds["local", n] for name, n in samples.seconds})
    links = fit_links(rates, link_shape(), flat)
    assert links.intra_node_bw == pytest.approx(large / t, rel=1e-6)  # the large transfer alone
    assert links.collective_latency_s == 1e-6
    assert (links.example_op_s, links.bag_op_s, links.replica_op_s) == (0.0, 0.0, 0.0)


LINKS_SCRIPT = r"""
import dataclasses, json, sys
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from ctr_lightning.embedding import SparseAdam
from ctr_lightning.topology import HardwareRates, ModelShape
from ctr_lightning.topology.calibration import measure_links
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10_000, feature_names=[f"f{i}"])
          for i in range(2)]
shape = ModelShape.dlrm(tables, SparseAdam(), 64, 13, (16,), (16, 1))
links = measure_links(HardwareRates.published("cpu"), shape, reps=3)
print("RESULT " + json.dumps(dataclasses.asdict(links)), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_measure_links_prices_every_sharding_between_two_ranks(run_ranks):
    # Row-wise, table-wise and data-parallel models run for real over gloo on 127.0.0.1.
    base = HardwareRates.published("cpu")
    for got in run_ranks(LINKS_SCRIPT, ["{port}"], world=2, ddp_env=False):
        assert 0 < got["intra_node_bw"] < math.inf and got["collective_latency_s"] > 0
        for term in ("example_op_s", "bag_op_s", "replica_op_s"):
            assert 0 <= got[term] < 1e-3, term  # a finite cost per feature, bag or row, never negative
        # What the links do not measure is left as it was.
        assert got["dense_flops"] == base.dense_flops and got["row_op_s"] == base.row_op_s
