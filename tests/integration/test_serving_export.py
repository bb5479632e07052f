"""``ctr-lightning export`` writes Parquet tables and a safetensors dense part that score a
batch as the trained model does (examples/score_exported.py reads them back)."""

import importlib.util
import json
from pathlib import Path

import lightning.pytorch as pl
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ctr_lightning.callbacks import TableSnapshots
from ctr_lightning.cli import main
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.embedding import StorageConfig
from ctr_lightning.models import DLRMModule

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("score_exported", ROOT / "examples" / "score_exported.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("snapshots", [True, False], ids=["table-snapshot", "tables-in-ckpt"])
def test_an_export_scores_a_batch_as_the_trained_model_does(tmp_path, snapshots):
    train, val = tmp_path / "train.tsv", tmp_path / "val.tsv"
    write_synthetic_criteo(train, rows=20 * 64, seed=0)
    write_synthetic_criteo(val, rows=256, seed=0, stream=1)  # ids the model never trained on, too
    pl.seed_everything(0)
    model = DLRMModule(embedding_dim=8, num_embeddings=5000, dense_arch_layer_sizes=[16], over_arch_layer_sizes=[16, 1],
                       storage=StorageConfig(device_rows=150, host_rows=0, ssd_dir=str(tmp_path / "ssd")))
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_last=True)]
    if snapshots:
        callbacks.append(TableSnapshots())
    else:
        model.embeddings.checkpoint_to_snapshots(None)  # every row in the .ckpt, asked for
    pl.Trainer(accelerator="cpu", max_steps=20, logger=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=callbacks, default_root_dir=tmp_path).fit(
        model, datamodule=CriteoDataModule(train_paths=[str(train)], batch_size=64))

    out = tmp_path / "serving"
    main(["export", "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"), "--out", str(out), "--rows_per_file", "300"])
    described = json.loads((out / "export.json").read_text())
    exported = model.embeddings._built().export()
    stored = {name: len(t["ids"]) for name, t in exported.items()}
    assert {name: t["rows"] for name, t in described["tables"].items()} == stored  # each stored row once
    if snapshots:  # the last snapshot is the third incremental one over the first: the export read the chain
        from ctr_lightning.callbacks.table_snapshots import snapshot_references
        from ctr_lightning.embedding.snapshots.table_snapshot import SnapshotManifest

        last = next(iter(snapshot_references(torch.load(tmp_path / "ckpt" / "last.ckpt")["state_dict"])))
        chain = SnapshotManifest.read(last).chain(last)
        assert len(chain) == 4 and sum(sum(f.rows.values()) for f in chain[0][1].files) < sum(stored.values())
    assert sum(stored.values()) > 1000
    table = described["tables"]["t_C1"]
    parts = [pq.read_table(out / f["path"]) for f in table["files"]]
    assert len(parts) > 1 and parts[0].schema.names == ["table", "id", "vector"]  # sharded into files
    assert parts[0].schema.field("vector").type.list_size == 8  # weights only, no Adam state

    batch = next(iter(CriteoDataModule(train_paths=[str(val)], batch_size=100).train_dataloader()))
    unseen = sum(int((~torch.isin(batch.sparse[f"C{i}"].values(), exported[f"t_C{i}"]["ids"])).sum())
                 for i in range(1, 27))
    assert unseen > 50  # scored with the initial rows the model would use
    model.eval()
    with torch.no_grad():
        expected = torch.sigmoid(model(batch))
    example = _example()
    served = example.score(example.load_model(out), batch.dense, batch.sparse)
    torch.testing.assert_close(served, expected, atol=1e-6, rtol=0)

    with pytest.raises(FileExistsError, match="not empty"):
        main(["export", "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"), "--out", str(out)])


@pytest.mark.parametrize("snapshots", [True, False], ids=["table-snapshot", "tables-in-ckpt"])
def test_an_export_keeps_the_first_order_column_of_a_deepfm(tmp_path, snapshots):
    from ctr_lightning.models import DeepFMModule

    train = write_synthetic_criteo(tmp_path / "train.tsv", rows=5 * 64, seed=0)
    model = DeepFMModule(embedding_dim=8, num_embeddings=5000, deep_layer_sizes=[8])
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)] + ([TableSnapshots()] if snapshots else [])
    if not snapshots:
        model.embeddings.checkpoint_to_snapshots(None)  # every row in the .ckpt, asked for
    pl.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=callbacks, default_root_dir=tmp_path).fit(
        model, datamodule=CriteoDataModule(train_paths=[str(train)], batch_size=64))
    out = tmp_path / "serving"
    main(["export", "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"), "--out", str(out)])
    table = json.loads((out / "export.json").read_text())["tables"]["t_C1"]
    assert table["dim"] == 9  # 8 + the feature's first-order weight
    part = pq.read_table(out / table["files"][0]["path"]).to_pydict()
    ids = torch.tensor(part["id"])
    torch.testing.assert_close(torch.tensor(part["vector"]), model.embeddings.rows("t_C1", ids))
