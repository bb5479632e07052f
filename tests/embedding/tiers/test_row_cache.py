import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseSGD, StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.embedding.tiers.row_cache import RowCache, Rows

HOT = 1000


def _put(cache: RowCache, ids: list[int]) -> None:
    """What a tier's user does for rows it does not hold: evict, then insert, then touch."""
    tables = np.zeros(len(ids), dtype=np.int64)
    victims, _ = cache.choose_victims(cache.room_needed(tables), np.empty(0, dtype=np.int64), ["t"])
    cache.release(victims)
    slots = cache.insert(Rows(tables, np.array(ids, dtype=np.int64), torch.zeros(len(ids), 2),
                              np.zeros(len(ids), dtype=bool)))
    cache.touch(slots)


@pytest.mark.parametrize("lfu", [True, False])
def test_a_hot_row_survives_a_scan_under_lfu_only(lfu):
    cache = RowCache(width=2, capacities=[4], lfu=[lfu], device="cpu")
    _put(cache, [HOT])
    for _ in range(10):  # used often, then not at all while a scan passes through
        cache.touch(cache.lookup(np.zeros(1, dtype=np.int64), np.array([HOT])))
    for i in range(40):
        _put(cache, [i])
    held = cache.lookup(np.zeros(1, dtype=np.int64), np.array([HOT]))[0] >= 0
    assert held == lfu
    assert len(cache) == 4


@pytest.mark.parametrize("eviction", ["lfu", "lru"])
def test_the_collection_keeps_a_hot_row_through_a_scan_under_lfu_only(tmp_path, eviction):
    table = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=1000, feature_names=["f"])
    ebc = TieredEmbeddingBagCollection([table], optimizer=SparseSGD(lr=0.1), storage=StorageConfig(
        device_rows=8, host_rows=0, ssd_dir=str(tmp_path), eviction=eviction))

    def step(ids: list[int]) -> None:
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor(ids),
                                                  lengths=torch.ones(len(ids), dtype=torch.int64))
        ebc(kjt).values().sum().backward()

    for _ in range(10):
        step([HOT, 1, 2])
    for start in range(10, 200, 4):  # a scan of never-seen ids, four a step
        step(list(range(start, start + 4)))
    before = ebc.tier_stats()
    step([HOT])
    after = ebc.tier_stats()
    from_device = after["device_hits"] - before["device_hits"]
    from_ssd = after["ssd_hits"] - before["ssd_hits"]
    assert (from_device, from_ssd) == ((1, 0) if eviction == "lfu" else (0, 1))


def test_a_bounded_tier_never_grows_its_index_while_it_fills():
    cache = RowCache(2, [30_000], [False], "cpu")
    size = len(cache.index._keys)
    for start in range(0, 60_000, 5_000):  # fills, then evicts and refills
        _put(cache, list(range(start, start + 5_000)))
    assert len(cache.index._keys) == size and len(cache.index) > 25_000


def _held(cache: RowCache, ids: list[int]) -> list[bool]:
    return (cache.lookup(np.zeros(len(ids), dtype=np.int64), np.array(ids, dtype=np.int64)) >= 0).tolist()


def _use(cache: RowCache, row: int, times: int) -> None:
    for _ in range(times):
        cache.touch(cache.lookup(np.zeros(1, dtype=np.int64), np.array([row])))


def test_lfu_evicts_the_least_used_and_among_equals_the_least_recent():
    cache = RowCache(width=2, capacities=[3], lfu=[True], device="cpu")
    for row in (1, 2, 3):
        _put(cache, [row])  # one use each; 1 the least recent
    _use(cache, 1, 2)  # 1: three uses, the most recent
    _put(cache, [4])  # 2 and 3 tie on one use: 2, the less recent, goes
    assert _held(cache, [1, 2, 3, 4]) == [True, False, True, True]
    _use(cache, 3, 1)  # 3: two uses; 4: one
    _put(cache, [5])
    assert _held(cache, [1, 3, 4, 5]) == [True, True, False, True]


def test_lru_ignores_use_counts():
    cache = RowCache(width=2, capacities=[3], lfu=[False], device="cpu")
    for row in (1, 2, 3):
        _put(cache, [row])
    _use(cache, 1, 5)
    _use(cache, 2, 1)  # 2 the most recent; 3 now the least recent, 1 used most
    _put(cache, [4])
    assert _held(cache, [1, 2, 3, 4]) == [True, True, False, True]


def test_a_row_back_from_below_starts_counting_again():
    # Counts live with the slot: an evicted row that returns (from DRAM or SSD) competes
    # with one use, not with what it had before it left.
    cache = RowCache(width=2, capacities=[2], lfu=[True], device="cpu")
    _put(cache, [1])
    _use(cache, 1, 4)  # 1: five uses
    _put(cache, [2])
    _use(cache, 2, 9)  # 2: ten uses
    _put(cache, [3])  # 1 (5) goes, 2 (10) stays
    assert _held(cache, [1, 2, 3]) == [False, True, True]
    _put(cache, [1])  # back: one use; 3 (one use, less recent) made room
    assert _held(cache, [1, 2, 3]) == [True, True, False]
    _put(cache, [3])  # 3 returns: 1 goes (one use, less recent), though it had five before it left
    assert _held(cache, [1, 2, 3]) == [False, True, True]
