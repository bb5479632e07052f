import math

import numpy as np
import pytest
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding import SparseAdam
from ctr_lightning.topology import HardwareRates, ModelShape
from ctr_lightning.topology.calibration import _windows, measure_rates, zipf_ids


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


def test_measure_rates_on_this_machine(tmp_path):
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=3000, feature_names=[f"f{i}"])
              for i in range(2)]
    shape = ModelShape.dlrm(tables, SparseAdam(), 256, 13, (16,), (16, 1))
    # So small a batch reads too few rows a step for the tier's parallel reads, and says so.
    with pytest.warns(UserWarning, match="SSD calibration: .* rows read a step"):
        rates = measure_rates(shape, threads=1, ssd_dir=str(tmp_path), rows=3000, steps=2)
    assert 0 < rates.dense_flops < 1e13 and rates.row_op_s >= 0
    assert rates.ssd_read_iops > 0 and rates.ssd_read_unit >= 4096
    assert list(tmp_path.iterdir()) == []  # its SSD files are gone


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
