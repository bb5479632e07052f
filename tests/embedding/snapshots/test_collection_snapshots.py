"""A collection's snapshot bookkeeping (collection_snapshots.py): which snapshot an
incremental save builds on, and which one a state dict refers to."""

import shutil

import torch

from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

from .test_table_snapshot import TABLES, full_state, growing_workload, loss_of, trained


def test_an_incremental_snapshot_builds_only_on_one_in_its_own_folder(tmp_path):
    ebc, _ = trained(StorageConfig(), steps=10)
    more = list(growing_workload(16))[10:]
    saves = []
    for n, folder in enumerate(("a", "a", "b")):
        for kjt, target in more[2 * n : 2 * n + 2]:
            loss_of(ebc(kjt), target).backward()
        saves.append(ebc.save_tables(tmp_path / folder / f"s{n}", incremental=True))
    assert [m.parent is not None for m in saves] == [False, True, False]
    # Loaded from one folder, saved into another (a run resumed from another run's
    # checkpoint): every row, so the first folder may go.
    other = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
    other.load_tables(tmp_path / "a" / "s1")
    assert other.save_tables(tmp_path / "c" / "s3", incremental=True).parent is None
    shutil.rmtree(tmp_path / "a")
    again = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
    again.load_tables(tmp_path / "c" / "s3")
    want, got = full_state(other), full_state(again)
    assert all(torch.equal(want[t][1], got[t][1]) for t in want)


def test_a_state_dict_refers_to_a_snapshot_of_the_rows_it_has_now(tmp_path):
    ebc, keys = trained(StorageConfig(), steps=10)
    ebc.checkpoint_to_snapshots(tmp_path / "root")
    first = ebc.get_extra_state()
    assert ebc.get_extra_state() == first  # the same rows: the same snapshot
    other, _ = trained(StorageConfig(), steps=3)
    other.save_tables(tmp_path / "other")
    ebc.load_tables(tmp_path / "other")  # other rows now: a state dict must not name the first snapshot
    second = ebc.get_extra_state()
    assert second["snapshot"] != first["snapshot"]
    ebc.set_extra_state(first)
    for t, ids in keys.items():
        assert torch.equal(ebc.rows(t, ids), trained(StorageConfig(), steps=10)[0].rows(t, ids)), t
    assert len(ebc.snapshots_written) == 2
