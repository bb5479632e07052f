"""Checkpoints whose files were copied, moved away or damaged: a copied run directory
resumes from its own snapshots, a run resumed from another run's checkpoint needs none of
that run's files once it has saved, and with ``link_segments=False`` a damaged snapshot
leaves the other checkpoints loadable (with hard-linked segments it does not)."""

import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ctr_lightning.callbacks import TableSnapshots
from ctr_lightning.callbacks.table_snapshots import snapshot_references
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.embedding import StorageConfig
from ctr_lightning.embedding.snapshots.row_files import RowFileError
from ctr_lightning.embedding.snapshots.table_snapshot import SnapshotManifest
from ctr_lightning.models import DLRMModule
from ctr_lightning.serving_export import export_for_serving

EVERY = 6


def model(ssd_dir: Path) -> DLRMModule:
    # 4 KiB segments: the SSD log seals segments within a few steps, so snapshots share them.
    return DLRMModule(embedding_dim=8, num_embeddings=5000, dense_arch_layer_sizes=[16], over_arch_layer_sizes=[16, 1],
                      storage=StorageConfig(device_rows=150, host_rows=0, ssd_dir=str(ssd_dir),
                                            ssd_segment_bytes=4 << 10))


def fit(work: Path, data: Path, max_steps: int, ckpt_path: Path | None = None, **snapshots) -> DLRMModule:
    pl.seed_everything(0)
    trained = model(work / "ssd")
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=work,
                         callbacks=[ModelCheckpoint(dirpath=work / "ckpt", every_n_train_steps=EVERY, save_top_k=-1,
                                                    monitor="step", mode="max", save_last=True),
                                    TableSnapshots(**snapshots)])
    trainer.fit(trained, datamodule=CriteoDataModule(train_paths=[str(data)], batch_size=64),
                ckpt_path=str(ckpt_path) if ckpt_path else None)
    return trained


def rows_of(module: DLRMModule) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for name, table in module.embeddings._built().export().items():
        order = torch.argsort(table["ids"])
        out[name] = (table["ids"][order], table["rows"][order])
    return out


def assert_same_rows(a: DLRMModule, b: DLRMModule) -> None:
    want, got = rows_of(a), rows_of(b)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name][0], got[name][0]) and torch.equal(want[name][1], got[name][1]), name


def snapshot_of(ckpt: Path) -> Path:
    [snapshot] = snapshot_references(torch.load(ckpt, weights_only=True)["state_dict"])
    return Path(snapshot)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "day_0.tsv"
    write_synthetic_criteo(path, rows=3 * EVERY * 64 + 500, seed=0)
    return path


def test_a_copied_run_directory_resumes_from_its_own_snapshots(tmp_path, data):
    original = fit(tmp_path / "original", data, 2 * EVERY)  # the last snapshot is incremental over the first
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    # The original goes on changing (here: every row file damaged) while it still exists at
    # the paths the copied checkpoints record: the copy must read its own files.
    for path in (tmp_path / "original" / "ckpt" / "table_snapshots").rglob("*.rows"):
        flip_a_byte(path)
    last = tmp_path / "copy" / "ckpt" / "last.ckpt"
    assert snapshot_of(last).is_relative_to(tmp_path / "original")
    assert SnapshotManifest.read(snapshot_of(last)).parent is not None
    resumed = fit(tmp_path / "copy", data, 2 * EVERY, ckpt_path=last)  # restores, nothing left to train
    assert_same_rows(original, resumed)
    assert resumed.embeddings.current_snapshot().is_relative_to(tmp_path / "copy")
    # So does `ctr-lightning export` of a copied checkpoint (it verifies every file it reads).
    (first,) = (tmp_path / "copy" / "ckpt").glob(f"*step={EVERY}.ckpt")
    description = export_for_serving(first, tmp_path / "export")
    assert description["tables"]


def test_a_run_resumed_from_another_runs_checkpoint_saves_every_row_first(tmp_path, data):
    fit(tmp_path / "source", data, EVERY)
    resumed = fit(tmp_path / "resumed", data, 2 * EVERY, ckpt_path=tmp_path / "source" / "ckpt" / "last.ckpt")
    shutil.rmtree(tmp_path / "source")
    last = tmp_path / "resumed" / "ckpt" / "last.ckpt"
    restored = DLRMModule.load_from_checkpoint(last, storage=StorageConfig(device_rows=150, host_rows=0,
                                                                          ssd_dir=str(tmp_path / "restored")))
    assert_same_rows(resumed, restored)
    assert SnapshotManifest.read(snapshot_of(last)).parent is None  # every row, not incremental over the source's


@pytest.mark.parametrize("link_segments", [True, False], ids=["linked", "copied"])
def test_one_damaged_snapshot_leaves_the_others_loadable_only_with_copied_segments(tmp_path, data, link_segments):
    fit(tmp_path / "run", data, 2 * EVERY, full_every=1, link_segments=link_segments)
    first, second = (tmp_path / "run" / "ckpt" / f"epoch=0-step={n}.ckpt" for n in (EVERY, 2 * EVERY))
    manifests = [SnapshotManifest.read(snapshot_of(ckpt)) for ckpt in (first, second)]
    kinds = {f.kind for m in manifests for f in m.files}
    assert kinds == ({"rows", "segments"} if link_segments else {"rows"})
    # One file of the first checkpoint's snapshot is damaged: a sealed segment the second
    # snapshot links too when linked, its own row file when copied.
    if link_segments:
        also_second = {p.stat().st_ino for p in snapshot_of(second).glob("*.seg")}
        damaged = next(p for p in sorted(snapshot_of(first).glob("*.seg")) if p.stat().st_ino in also_second)
    else:
        assert not list(snapshot_of(first).glob("*.seg")) and not list(snapshot_of(second).glob("*.seg"))
        damaged = max(snapshot_of(first).glob("*.rows"), key=lambda p: p.stat().st_size)
    flip_a_byte(damaged)

    def load(ckpt: Path, name: str) -> DLRMModule:
        return DLRMModule.load_from_checkpoint(ckpt, storage=StorageConfig(device_rows=150, host_rows=0,
                                                                           ssd_dir=str(tmp_path / name)))

    with pytest.raises(RowFileError, match=rf"{damaged.name} \(tables .*\) does not match its checksum"):
        load(first, "first")
    if link_segments:  # the same bytes under the second snapshot's name: that checkpoint is lost too
        with pytest.raises(RowFileError, match=r"\.seg \(tables .*\) does not match its checksum"):
            load(second, "second")
    else:
        load(second, "second")
