import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding import TieredEmbeddingBagCollection
from ctr_lightning.embedding.sharding_plan import TableSharding, plan_sharding, row_owner


def test_plan_sharding_places_tables():
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"f{i}"])
              for i, n in enumerate([10**6, 1000, 800, 600, 400])]
    plan = plan_sharding(tables, world_size=2, sharding="auto")
    assert plan["t0"] == TableSharding("row_wise")  # larger than half of all rows
    small = [plan[f"t{i}"].owner for i in range(1, 5)]
    assert plan["t1"].kind == "table_wise" and sorted(set(small)) == [0, 1]
    assert plan_sharding(tables, 3, "table_wise")["t0"].owner == 0
    with pytest.raises(ValueError, match=r"table 't1': sharding must be"):
        plan_sharding(tables, 2, {"t0": "row_wise", "t1": "column_wise", "t2": "auto", "t3": "auto", "t4": "auto"})
    with pytest.raises(ValueError, match=r"tables without a setting \['t4'\]"):
        plan_sharding(tables, 2, {f"t{i}": "auto" for i in range(4)})
    with pytest.raises(ValueError, match="sharding must be"):
        TieredEmbeddingBagCollection(tables, sharding="rows")


def test_row_owner_spreads_ids_evenly():
    for ids in (torch.arange(100_000), torch.from_numpy(np.random.default_rng(0).integers(0, 2**62, 100_000))):
        counts = torch.bincount(row_owner(ids, 4), minlength=4)
        assert counts.min() > 0.95 * 25_000 and counts.max() < 1.05 * 25_000
