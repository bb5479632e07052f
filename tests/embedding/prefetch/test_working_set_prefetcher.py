import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection, WorkingSetPrefetcher

TABLES = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=5000, feature_names=[f"f{i}"])
          for i in range(2)]


def zipf_batches(steps, batch=128, seed=0):
    rng = np.random.default_rng(seed)
    return [KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.from_numpy(rng.zipf(1.2, size=2 * batch) % 5000),
        lengths=torch.ones(2 * batch, dtype=torch.int32)) for _ in range(steps)]


def train(batches, storage, lookahead=None):
    ebc = TieredEmbeddingBagCollection(TABLES, storage=storage, optimizer=SparseAdam(lr=0.05))
    loop = batches if lookahead is None else WorkingSetPrefetcher(batches, ebc, lookahead, release_on_next=True)
    weights = torch.randn(16, generator=torch.Generator().manual_seed(0))
    for kjt in loop:
        (ebc(kjt).values() @ weights).sum().backward()
    return ebc


@pytest.mark.parametrize("id_space", ["hashed", "bounded"])
@pytest.mark.parametrize("device_rows,lookahead", [(150, 6), (100, 12)])
def test_prefetched_training_equals_fetching_on_demand(tmp_path, id_space, device_rows, lookahead):
    batches = zipf_batches(40)
    plain = train(batches, StorageConfig(device_rows=device_rows, host_rows=0, ssd_dir=str(tmp_path / "a")))
    ebc = TieredEmbeddingBagCollection(
        TABLES, storage=StorageConfig(device_rows=device_rows, host_rows=0, ssd_dir=str(tmp_path / "b")),
        optimizer=SparseAdam(lr=0.05), id_space=id_space)
    weights = torch.randn(16, generator=torch.Generator().manual_seed(0))
    for kjt in WorkingSetPrefetcher(batches, ebc, lookahead, release_on_next=True):
        (ebc(kjt).values() @ weights).sum().backward()
    stats = ebc.tier_stats()
    ids = np.arange(5000)
    for t in ("t0", "t1"):
        assert torch.equal(ebc.rows(t, ids), plain.rows(t, ids))  # bit for bit
    assert stats["prefetch_bytes"] == stats["prefetched_rows"] * (8 + 16) * 4
    assert len(ebc._built().groups[0].working_set.staged) == 0  # all released at the end
    if lookahead == 6:  # the lookahead's working set fits in the device tier: no waiting on SSD
        assert stats["prefetch_hits"] > 500 and stats["ssd_hits"] == 0 and stats["prefetch_stale"] == 0
    else:
        # It does not fit: rows read ahead were written back by earlier batches before
        # their own ran, and were re-read from SSD rather than served stale.
        assert stats["prefetch_stale"] > 0 and stats["prefetch_hits"] > 0


def test_rows_needed_ahead_are_not_evicted(tmp_path):
    def kjt(ids):
        return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.tensor(ids + ids),
                                                   lengths=torch.ones(2 * len(ids), dtype=torch.int32))
    a = list(range(20))
    # Batches 1-4 each evict what is least recently used: a, unless it is spared for batch 5.
    batches = [kjt(a)] + [kjt(list(range(100 * k, 100 * k + 30))) for k in range(1, 5)] + [kjt(a)]

    def misses_of_last(lookahead):
        ebc = TieredEmbeddingBagCollection(
            TABLES, storage=StorageConfig(device_rows=60, host_rows=0, ssd_dir=str(tmp_path / str(lookahead))))
        loop = batches if lookahead is None else WorkingSetPrefetcher(batches, ebc, lookahead, release_on_next=True)
        for i, batch in enumerate(loop):
            before = ebc.tier_stats()["device_hits"]
            ebc(batch).values().sum().backward()
        return 2 * len(a) - (ebc.tier_stats()["device_hits"] - before)

    assert misses_of_last(None) == 2 * len(a)
    assert misses_of_last(5) == 0


def test_bad_arguments_are_reported():
    ebc = TieredEmbeddingBagCollection(TABLES)
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        WorkingSetPrefetcher([], ebc, lookahead=0)
    with pytest.raises(ValueError, match="needs at least one TieredEmbeddingBagCollection"):
        WorkingSetPrefetcher([], [], lookahead=2)
    bad = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.tensor([1, -3]),
                                              lengths=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="table 't1': id -3 is negative"):
        list(WorkingSetPrefetcher([bad], ebc, lookahead=2))


# Each rank trains its own batches twice, fetching on demand and through the prefetcher,
# with rows owned across ranks and the SSD tier in use.
