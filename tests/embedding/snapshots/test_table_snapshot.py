"""Table snapshots: streamed from every tier, checked by their manifest, loaded into any budgets."""

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.embedding.snapshots.row_files import RowFileError, read_row_file

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=1000, feature_names=["f1", "f2"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=1000, feature_names=["f3"]),
]


def growing_workload(steps, batch=8, new_per_step=10, bounded=False):
    """Hashed ids of a growing table: a hot head, ids seen before, and new ones."""
    gen = torch.Generator().manual_seed(5)
    for step in range(steps):
        lengths = torch.randint(1, 3, (4 * batch,), generator=gen)
        n = int(lengths.sum())
        values = torch.randint(0, (step + 1) * new_per_step, (n,), generator=gen)
        values[:new_per_step] = step * new_per_step + torch.arange(new_per_step)
        values = values % 1000 if bounded else values * 104729 + 2**50
        yield (KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2", "f3"], values=values, lengths=lengths),
               torch.randn(batch, 28, generator=gen))


def loss_of(kt, target):
    return (kt.values() * target).sum() + 0.5 * (kt.values() ** 2).sum()


def trained(storage, steps=120, id_space="hashed"):
    ebc = TieredEmbeddingBagCollection(TABLES, storage=storage, optimizer=SparseAdam(lr=0.05), id_space=id_space)
    keys = {t.name: set() for t in TABLES}
    for kjt, target in growing_workload(steps, bounded=id_space == "bounded"):
        for key, jt in kjt.to_dict().items():
            keys[next(t.name for t in TABLES if key in t.feature_names)].update(jt.values().tolist())
        loss_of(ebc(kjt), target).backward()
    return ebc, {t: np.array(sorted(v)) for t, v in keys.items()}


@pytest.mark.parametrize("id_space", ["hashed", "bounded"])
def test_a_snapshot_of_tiny_tiers_loads_into_other_budgets_and_trains_on_identically(tmp_path, id_space):
    tiny = StorageConfig(device_rows=60, host_rows=40, ssd_dir=str(tmp_path / "a"), ssd_segment_bytes=4 << 10)
    ebc, keys = trained(tiny, id_space=id_space)
    manifest = ebc.save_tables(tmp_path / "snap")
    # Rows from all three tiers, each once.
    assert sum(sum(f.rows.values()) for f in manifest.files) == sum(len(v) for v in keys.values())
    with pytest.raises(FileExistsError, match="exists already"):
        ebc.save_tables(tmp_path / "snap")
    others = []
    for storage in (StorageConfig(), StorageConfig(device_rows=100, host_rows=0, ssd_dir=str(tmp_path / "b"))):
        other = TieredEmbeddingBagCollection(TABLES, storage=storage, optimizer=SparseAdam(lr=0.05),
                                             id_space=id_space)
        other.load_tables(tmp_path / "snap")
        for t, ids in keys.items():
            assert torch.equal(other.rows(t, ids), ebc.rows(t, ids)), t
        others.append(other)
    # Optimizer state and step counts came along: the next steps agree bit for bit.
    for model in (ebc, *others):
        for kjt, target in list(growing_workload(130, bounded=id_space == "bounded"))[120:]:
            loss_of(model(kjt), target).backward()
    for other in others:
        for t, ids in keys.items():
            assert torch.equal(other.rows(t, ids), ebc.rows(t, ids)), t


def test_a_flipped_byte_or_a_missing_manifest_is_named(tmp_path):
    ebc, _ = trained(StorageConfig(device_rows=60, host_rows=0, ssd_dir=str(tmp_path / "a")), steps=30)
    manifest = ebc.save_tables(tmp_path / "snap")
    target = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
    damaged = tmp_path / "snap" / manifest.files[0].name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    with pytest.raises(RowFileError, match=rf"{manifest.files[0].name} \(tables \['t0'\]\) does not match its "
                                           "checksum"):
        target.load_tables(tmp_path / "snap")
    # Past the manifest's check (as if it had been damaged too), the chunk's own CRC names it.
    with pytest.raises(RowFileError, match=rf"{damaged}: checksum mismatch in the chunk at byte \d+ of \d+ rows"):
        list(read_row_file(damaged))
    # A save killed before its manifest leaves row files only: not loadable, and said so.
    (tmp_path / "snap" / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no manifest.json, so it is incomplete"):
        target.load_tables(tmp_path / "snap")


def test_a_damaged_manifest_is_named(tmp_path):
    ebc, _ = trained(StorageConfig(), steps=10)
    ebc.save_tables(tmp_path / "s0")
    for kjt, target in list(growing_workload(12))[10:]:
        loss_of(ebc(kjt), target).backward()
    ebc.save_tables(tmp_path / "s1", incremental=True)
    target = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
    manifest = tmp_path / "s0" / "manifest.json"
    text = manifest.read_text()
    named = re.escape(str(manifest))
    for damage, says in ((text[: len(text) // 2], "not readable as JSON"), ("\x00\xff" * 8, "not readable as JSON"),
                         (json.dumps({"format": json.loads(text)["format"]}), "a field is missing")):
        manifest.write_bytes(damage.encode("latin-1"))
        with pytest.raises(ValueError, match=rf"{named}: damaged manifest, {says}"):
            target.load_tables(tmp_path / "s0")
        # The parent of an incremental snapshot: the parent's manifest is the one named.
        with pytest.raises(ValueError, match=rf"{named}: damaged manifest, {says}"):
            target.load_tables(tmp_path / "s1")


def test_a_snapshot_of_other_rows_is_refused_naming_the_table(tmp_path):
    ebc, _ = trained(StorageConfig(), steps=5)
    ebc.save_tables(tmp_path / "snap")
    wider = [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim * 2, num_embeddings=t.num_embeddings,
                                feature_names=t.feature_names, pooling=t.pooling) for t in TABLES]
    with pytest.raises(ValueError, match=r"table 't0': snapshot rows have dim 8 and width 24 .* this collection "
                                         r"stores dim 16"):
        TieredEmbeddingBagCollection(wider, optimizer=SparseAdam()).load_tables(tmp_path / "snap")
    smaller = [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=10,
                                  feature_names=t.feature_names, pooling=t.pooling) for t in TABLES]
    with pytest.raises(ValueError, match=r"table 't0': snapshot of 1000 rows \(num_embeddings\) does not fit a "
                                         r"bounded table of 10"):
        TieredEmbeddingBagCollection(smaller, optimizer=SparseAdam(), id_space="bounded").load_tables(tmp_path / "snap")
    manifest = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and set(manifest["tables"]) == {"t0", "t1", "t2"}


def full_state(ebc):
    """Every stored row with its optimizer state, by table, in id order."""
    out = {}
    for name, table in ebc._built().export().items():
        order = torch.argsort(table["ids"])
        out[name] = (table["ids"][order], table["rows"][order], table["steps"])
    return out


@pytest.mark.parametrize("id_space", ["hashed", "bounded"])  # the SSD log, and the in-place SSD store
def test_incremental_snapshots_hold_the_changed_rows_and_load_as_a_chain(tmp_path, id_space):
    tiny = StorageConfig(device_rows=60, host_rows=40, ssd_dir=str(tmp_path / "a"), ssd_segment_bytes=4 << 10)
    ebc, _ = trained(tiny, steps=120, id_space=id_space)
    full = ebc.save_tables(tmp_path / "s0", incremental=True)  # nothing to build on yet: every row
    assert full.parent is None
    hot = list(growing_workload(4, bounded=id_space == "bounded"))  # rows stored long ago
    chain = [full]
    for n in (1, 2):
        for kjt, target in hot:
            loss_of(ebc(kjt), target).backward()
        chain.append(ebc.save_tables(tmp_path / f"s{n}", incremental=True))
        assert chain[-1].parent.path == str((tmp_path / f"s{n - 1}").resolve())
    rows = [sum(sum(f.rows.values()) for f in m.files) for m in chain]
    assert rows[1] < rows[0] / 4 and rows[2] < rows[0] / 4, rows  # the changed rows, not the table

    for storage in (StorageConfig(), StorageConfig(device_rows=100, host_rows=0, ssd_dir=str(tmp_path / "b"))):
        other = TieredEmbeddingBagCollection(TABLES, storage=storage, optimizer=SparseAdam(lr=0.05), id_space=id_space)
        other.load_tables(tmp_path / "s2")  # s2, s1's changes under it, s0 under both
        want, got = full_state(ebc), full_state(other)
        assert want.keys() == got.keys()
        for t in want:
            assert torch.equal(want[t][0], got[t][0]) and torch.equal(want[t][1], got[t][1]), t
            assert want[t][2] == got[t][2]
    # A full save after a load, and an incremental one over what was loaded, load alike.
    other.save_tables(tmp_path / "s3", incremental=True)
    again = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05), id_space=id_space)
    again.load_tables(tmp_path / "s3")
    assert all(torch.equal(a[1], b[1]) for a, b in zip(full_state(again).values(), full_state(ebc).values()))

    # The chain is checked: a parent gone, or replaced, is named.
    shutil.rmtree(tmp_path / "s1")
    with pytest.raises(FileNotFoundError, match=r"s2 is incremental over .*s1, which is gone"):
        again.load_tables(tmp_path / "s2")


def _inodes(directory, pattern="*"):
    return {p.stat().st_ino for p in directory.glob(pattern)}


def test_sealed_ssd_segments_are_shared_by_hard_link_and_taken_back_on_load(tmp_path):
    tiny = StorageConfig(device_rows=60, host_rows=40, ssd_dir=str(tmp_path / "a"), ssd_segment_bytes=4 << 10)
    ebc, _ = trained(tiny)
    want = full_state(ebc)
    manifest = ebc.save_tables(tmp_path / "snap")
    shared = [f for f in manifest.files if f.kind == "segments"]
    written = sum(f.bytes for f in manifest.files)
    assert len(shared) >= 2 and sum(f.shared_bytes for f in shared) > 3 * written, manifest.files
    assert sum(sum(f.rows.values()) for f in manifest.files) == sum(len(v[0]) for v in want.values())
    linked = list((tmp_path / "snap").glob("*.seg"))
    assert linked and _inodes(tmp_path / "snap", "*.seg") <= _inodes(tmp_path / "a", "*.seg")  # no copy
    # Training on rewrites rows and cleans segments away: the snapshot keeps its own.
    for kjt, target in list(growing_workload(200))[120:]:
        loss_of(ebc(kjt), target).backward()
    assert any(p.stat().st_nlink == 1 for p in linked)
    layouts = {"same segments": StorageConfig(device_rows=60, host_rows=0, ssd_dir=str(tmp_path / "b"),
                                              ssd_segment_bytes=4 << 10),
               "smaller segments": StorageConfig(device_rows=60, host_rows=0, ssd_dir=str(tmp_path / "c"),
                                                 ssd_segment_bytes=2 << 10),
               "memory": StorageConfig()}
    for label, storage in layouts.items():
        other = TieredEmbeddingBagCollection(TABLES, storage=storage, optimizer=SparseAdam(lr=0.05))
        other.load_tables(tmp_path / "snap")
        got = full_state(other)
        for t in want:
            assert torch.equal(want[t][0], got[t][0]) and torch.equal(want[t][1], got[t][1]), (label, t)
        if label == "same segments":
            # Nothing changed since the load: an incremental save over it holds no row.
            again = other.save_tables(tmp_path / "after_load", incremental=True)
            assert sum(sum(f.rows.values()) for f in again.files) == 0, again.files
    # Same record layout: the segments were taken back by hard link, none was rewritten.
    assert _inodes(tmp_path / "snap", "*.seg") <= _inodes(tmp_path / "b", "*.seg")
    assert not _inodes(tmp_path / "snap", "*.seg") & _inodes(tmp_path / "c", "*.seg")


LINK_REFUSED_SCRIPT = r"""
import os, subprocess, sys
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection
root = sys.argv[1]
os.makedirs(f"{root}/elsewhere", exist_ok=True)
os.makedirs(f"{root}/bound", exist_ok=True)
# The same file system under a second mount: same st_dev, but link(2) across it is EXDEV.
subprocess.run(["mount", "--bind", f"{root}/elsewhere", f"{root}/bound"], check=True)
tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f0"])]
ebc = TieredEmbeddingBagCollection(tables, optimizer=SparseAdam(lr=0.05), storage=StorageConfig(
    device_rows=100, host_rows=0, ssd_dir=f"{root}/ssd", ssd_segment_bytes=4 << 10))
gen = torch.Generator().manual_seed(0)
for step in range(40):
    ids = torch.randint(0, 10 * (step + 1), (64,), generator=gen) * 7919 + 2**40
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=ids, lengths=torch.ones(64, dtype=torch.int32))
    (ebc(kjt).values() ** 2).sum().backward()
manifest = ebc.save_tables(f"{root}/bound/snap")
print("KINDS", sorted({f.kind for f in manifest.files}))
other = TieredEmbeddingBagCollection(tables, optimizer=SparseAdam(lr=0.05))
other.load_tables(f"{root}/bound/snap")
want, got = ebc._built().export()["t0"], other._built().export()["t0"]
order_w, order_g = torch.argsort(want["ids"]), torch.argsort(got["ids"])
print("EQUAL", torch.equal(want["ids"][order_w], got["ids"][order_g]) and torch.equal(want["rows"][order_w], got["rows"][order_g]))
"""


def test_a_file_system_that_refuses_hard_links_gets_the_rows_copied(tmp_path, in_mount_namespace):
    result = in_mount_namespace(LINK_REFUSED_SCRIPT, [str(tmp_path)])
    if "Permission denied" in result.stderr or "must be superuser" in result.stderr:
        pytest.skip("cannot mount here")
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("KINDS", "EQUAL")))
    assert lines == {"KINDS": "['rows']", "EQUAL": "True"}, result.stdout + result.stderr[-3000:]


def test_a_damaged_or_missing_shared_segment_is_named(tmp_path):
    tiny = StorageConfig(device_rows=60, host_rows=0, ssd_dir=str(tmp_path / "a"), ssd_segment_bytes=4 << 10)
    ebc, _ = trained(tiny, steps=60)
    ebc.save_tables(tmp_path / "snap")
    del ebc
    shutil.rmtree(tmp_path / "a")  # the snapshot holds its segments alone now
    segment = sorted((tmp_path / "snap").glob("rank0-group0.*.seg"))[0]
    data = bytearray(segment.read_bytes())
    data[len(data) // 3] ^= 0x01
    segment.write_bytes(bytes(data))
    target = TieredEmbeddingBagCollection(TABLES, optimizer=SparseAdam(lr=0.05))
    tables = re.escape(str(json.loads((tmp_path / "snap" / "rank0-group0.segments").open("rb").readline())["tables"]))
    with pytest.raises(RowFileError, match=rf"{segment.name} \(tables {tables}\) does not match its checksum "
                                           r"in rank0-group0.segments"):
        target.load_tables(tmp_path / "snap")
    segment.unlink()
    with pytest.raises(RowFileError, match=rf"{segment.name} \(tables {tables}\) is missing"):
        target.load_tables(tmp_path / "snap")


def test_snapshots_across_file_systems_copy_the_rows(tmp_path):
    other_fs = Path("/dev/shm")
    if not other_fs.is_dir() or os.stat(other_fs).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    elsewhere = Path(tempfile.mkdtemp(dir=other_fs, prefix="ctr-snapshot-test-"))
    try:
        tiny = StorageConfig(device_rows=60, host_rows=0, ssd_dir=str(tmp_path / "a"), ssd_segment_bytes=4 << 10)
        ebc, _ = trained(tiny, steps=60)
        want = full_state(ebc)
        # Saved on another file system: the rows are copied (no hard link can cross).
        manifest = ebc.save_tables(elsewhere / "snap")
        assert {f.kind for f in manifest.files} == {"rows"}
        # Saved beside the SSD files, loaded into an SSD tier elsewhere: read, not linked.
        ebc.save_tables(tmp_path / "snap")
        for snapshot in (elsewhere / "snap", tmp_path / "snap"):
            storage = StorageConfig(device_rows=60, host_rows=0, ssd_dir=str(elsewhere / "ssd"),
                                    ssd_segment_bytes=4 << 10)
            other = TieredEmbeddingBagCollection(TABLES, storage=storage, optimizer=SparseAdam(lr=0.05))
            other.load_tables(snapshot)
            got = full_state(other)
            assert all(torch.equal(want[t][1], got[t][1]) for t in want), snapshot
            del other
    finally:
        shutil.rmtree(elsewhere)


def test_a_snapshot_is_abandoned_only_once_no_writer_holds_it(tmp_path):
    import subprocess
    import sys

    from ctr_lightning.embedding.snapshots.table_snapshot import MANIFEST, abandoned, writing

    live, failed, done = tmp_path / "v000000001-00000001", tmp_path / "v000000001-00000002", tmp_path / "done"
    with writing(live, "rank0"), writing(live, "rank1"):
        # Another process sees the writers' locks, as a resumed run's rank 0 would.
        check = [sys.executable, "-c", "import sys; from ctr_lightning.embedding.snapshots.table_snapshot import abandoned; "
                 "print(abandoned(sys.argv[1]))", str(live)]
        assert subprocess.run(check, capture_output=True, text=True, check=True).stdout.strip() == "False"
        assert not abandoned(live)
    with pytest.raises(OSError):
        with writing(failed, "rank0"):
            raise OSError("disk full")
    assert abandoned(failed)  # what a failed (or killed) save leaves: its lock file, unlocked
    (failed / MANIFEST).write_text("{}")
    assert not abandoned(failed)  # complete
    with writing(done, "rank0"):
        pass
    assert not abandoned(done) and os.listdir(done) == []  # a completed block leaves no lock file
    assert not abandoned(tmp_path / "unmarked") and not abandoned(tmp_path / "missing")
    (tmp_path / "unmarked").mkdir()
    assert not abandoned(tmp_path / "unmarked")
