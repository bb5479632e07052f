import os
from pathlib import Path

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import AutoStorage, TieredEmbeddingBagCollection
from ctr_lightning.topology import PlanError, place_tables


def _tables(rows):
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"f{i}"])
            for i in range(2)]


def _auto(rows, ssd_dir, **auto):
    """A storage-auto collection of two tables, planned by ctr_lightning.topology's placer."""
    return TieredEmbeddingBagCollection(_tables(rows), storage=AutoStorage(ssd_dirs=(str(ssd_dir),), **auto),
                                        placer=place_tables)


def test_auto_storage_plans_budgets_from_this_machine_and_trains(tmp_path):
    ebc = _auto(5000, tmp_path, reserve_bytes=0)
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
    ebc = _auto(10**12, tmp_path)
    with pytest.raises(PlanError, match=r"rank 0: its tables hold .* GiB"):
        ebc.ssd_directories
    with pytest.raises(ValueError, match=r"storage must be .* 'auto'"):
        TieredEmbeddingBagCollection(_tables(10), storage="automatic")
    with pytest.raises(ValueError, match=r"AutoStorage.dram_fraction must be in \(0, 1\]"):
        AutoStorage(dram_fraction=1.5)


def test_restored_rows_wait_for_the_plan_made_at_the_start_of_fit(tmp_path):
    # Lightning restores a checkpoint before the strategy moves the module to its device and
    # before fit starts: the tiers must be planned then, with fit's batch size, not at load.
    trained = _auto(5000, tmp_path / "a", reserve_bytes=0)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.arange(64) * 7, torch.ones(64, dtype=torch.int32))
    trained(kjt).values().sum().backward()
    restored = TieredEmbeddingBagCollection(_tables(5000), storage=AutoStorage(ssd_dirs=(str(tmp_path / "b"),),
                                                                               reserve_bytes=0))
    trained.checkpoint_to_snapshots(None)  # whole rows in the state dict, asked for
    restored.load_state_dict(trained.state_dict())
    assert restored.placement is None
    placement = restored.plan_placement(batch_size=64, placer=place_tables)  # no placer until now
    assert placement.plan.examples_per_step == 64
    ids = torch.arange(0, 448, 7)
    assert torch.equal(restored.rows("t0", ids), trained.rows("t0", ids))
    assert not torch.equal(trained.rows("t0", ids), TieredEmbeddingBagCollection(_tables(5000)).rows("t0", ids))


def _trained(tmp_path, name):
    ebc = _auto(5000, tmp_path / name, reserve_bytes=0)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.arange(64) * 7, torch.ones(64, dtype=torch.int32))
    ebc(kjt).values().sum().backward()
    return ebc, kjt


def test_a_training_step_after_a_waiting_restore_is_in_the_next_snapshot(tmp_path):
    trained, kjt = _trained(tmp_path, "a")
    trained.checkpoint_to_snapshots(tmp_path / "snapshots")
    state = trained.state_dict()
    restored = _auto(5000, tmp_path / "b", reserve_bytes=0)
    restored.checkpoint_to_snapshots(tmp_path / "snapshots")
    restored.load_state_dict(state)
    restored(kjt).values().sum().backward()  # the first use builds, restores, then trains
    saved = restored.get_extra_state()
    assert saved["snapshot"] != state["_extra_state"]["snapshot"] and len(restored.snapshots_written) == 1
    ids = torch.arange(0, 448, 7)
    assert not torch.equal(restored.rows("t0", ids), trained.rows("t0", ids))  # trained once more


def test_a_waiting_restore_that_fails_fails_every_use_and_survives_a_copy(tmp_path):
    import copy

    trained, kjt = _trained(tmp_path, "a")
    ids = torch.arange(0, 448, 7)
    fresh = lambda: _auto(5000, tmp_path / "b", reserve_bytes=0)  # noqa: E731
    # Rows in the checkpoint: a deep copy taken while they wait restores them itself.
    waiting = fresh()
    trained.checkpoint_to_snapshots(None)
    waiting.load_state_dict(trained.state_dict())
    assert torch.equal(copy.deepcopy(waiting).rows("t0", ids), trained.rows("t0", ids))
    # A snapshot whose row files are gone after the checkpoint was read: each use raises.
    trained.checkpoint_to_snapshots(tmp_path / "snapshots")
    state = trained.state_dict()
    broken = fresh()
    broken.load_state_dict(state)
    for f in Path(state["_extra_state"]["snapshot"]).rglob("*"):
        if f.is_file() and f.name != "manifest.json":
            f.unlink()
    for _ in range(2):
        with pytest.raises(Exception):
            broken.rows("t0", ids)
