import os

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import AutoStorage, TieredEmbeddingBagCollection
from ctr_lightning.topology import PlanError


def _tables(rows):
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"f{i}"])
            for i in range(2)]


def test_auto_storage_plans_budgets_from_this_machine_and_trains(tmp_path):
    ebc = TieredEmbeddingBagCollection(_tables(5000), storage=AutoStorage(ssd_dirs=(str(tmp_path),), reserve_bytes=0))
    assert ebc.placement is None  # planned when built, where the rank is known
    assert ebc.ssd_directories == [str(tmp_path)]
    placement = ebc.placement
    free = placement.plan.ranks[0].device_bytes
    assert 0 < free <= 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert all(s.ssd_dir == str(tmp_path) and s.device_rows == 5000 for s in placement.storage.values())
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.arange(64) * 7, torch.ones(64, dtype=torch.int32))
    ebc(kjt).values().sum().backward()
    assert ebc.rows("t0", torch.tensor([0])).shape == (1, 8)


def test_auto_storage_refuses_tables_that_fit_nowhere(tmp_path):
    ebc = TieredEmbeddingBagCollection(_tables(10**12), storage=AutoStorage(ssd_dirs=(str(tmp_path),)))
    with pytest.raises(PlanError, match=r"rank 0: its tables hold .* GiB"):
        ebc.ssd_directories
    with pytest.raises(ValueError, match=r"storage must be .* 'auto'"):
        TieredEmbeddingBagCollection(_tables(10), storage="automatic")
    with pytest.raises(ValueError, match=r"AutoStorage.dram_fraction must be in \(0, 1\]"):
        AutoStorage(dram_fraction=1.5)
