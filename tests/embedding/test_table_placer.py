"""storage auto: the collection plans nothing itself; a placer is passed in."""

from dataclasses import dataclass

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import (
    Admission,
    AutoStorage,
    Expiry,
    StorageConfig,
    TableSharding,
    TieredEmbeddingBagCollection,
    plan_sharding,
)


def _tables():
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=5000, feature_names=[f"f{i}"])
            for i in range(2)]


def _kjt():
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.arange(64) * 7, torch.ones(64, dtype=torch.int32))


@dataclass(frozen=True)
class InMemory:
    """What a placer returns: per table its tiers and its sharding."""

    storage: dict[str, StorageConfig]
    sharding_plan: dict[str, TableSharding]


class AllInMemory:
    """A placer written without ctr_lightning.topology: every row in the device tier."""

    def __init__(self):
        self.asked = []

    def __call__(self, tables, *, optimizer, sharding, auto, device, process_group, batch_size, access,
                 sparse_sync, k):
        self.asked.append((batch_size, access, sparse_sync, k))
        return InMemory({t.name: StorageConfig() for t in tables}, plan_sharding(tables, 1, sharding))


def test_storage_auto_without_a_placer_refuses_to_build_and_says_how_to_pass_one(tmp_path):
    ebc = TieredEmbeddingBagCollection(_tables(), storage=AutoStorage(ssd_dirs=(str(tmp_path),), reserve_bytes=0))
    for use in (lambda: ebc(_kjt()), lambda: ebc.ssd_directories, lambda: ebc.plan_placement(64)):
        with pytest.raises(RuntimeError, match=r"tables \['t0', 't1'\]: storage 'auto' has no placer.*"
                                               r"placer=ctr_lightning\.topology\.place_tables.*"
                                               r"ctr_lightning\.callbacks\.AutoPlacement"):
            use()
    assert ebc.placement is None and list(tmp_path.iterdir()) == []  # nothing planned, no file written
    placer = AllInMemory()
    placement = ebc.plan_placement(64, {"t0": "counted"}, placer=placer)  # the same collection, given one
    assert placement is ebc.placement and placer.asked == [(64, {"t0": "counted"}, "step", 1)]
    ebc(_kjt()).values().sum().backward()
    assert ebc.ssd_directories == [] and ebc.plan_placement(128, placer=placer) is placement  # planned once


def test_a_placer_given_up_front_plans_at_the_first_use_with_a_guess():
    placer = AllInMemory()
    ebc = TieredEmbeddingBagCollection(_tables(), storage="auto", placer=placer, sparse_sync="k_step", sync_every=4)
    assert ebc.placement is None
    ebc(_kjt())
    assert placer.asked == [(4096, None, "k_step", 4)]
    with pytest.raises(ValueError, match=r"placer is for storage 'auto'.*"):
        TieredEmbeddingBagCollection(_tables(), storage=StorageConfig(), placer=placer)



def test_planned_tiers_keep_the_tables_admission_and_expiry():
    # The plan rebuilds the tables' setup with its tiers; admission and expiry stay as given.
    ebc = TieredEmbeddingBagCollection(_tables(), storage="auto", placer=AllInMemory(),
                                       admission={"t0": Admission(admit_after=2)}, expiry=Expiry(ttl=1))
    ebc.train()
    ebc(_kjt()).values().sum().backward()  # 32 ids a table, once each: none admitted in t0, all stored in t1
    assert ebc.admission_counts()["t0"]["rejected"] == 32 and ebc.storage_stats()["memory_rows"] == 32
    for _ in range(2):
        later = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor([1, 2]), torch.ones(2, dtype=torch.int32))
        ebc(later).values().sum().backward()
    assert ebc.expiry_counts()["t1"]["expired"] == 32  # not looked up in 1 step: gone
