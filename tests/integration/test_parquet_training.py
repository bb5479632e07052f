import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctr_lightning.datamodules import ParquetDataModule
from ctr_lightning.models import DLRMModule


def write_day(path, rows, seed):
    rng = np.random.default_rng(seed)
    ad = rng.integers(0, 200, rows)
    table = pa.table({"click": (rng.random(rows) < 0.1 + 0.8 * (ad % 2)).astype(np.int64),
                      "price": rng.random(rows), "ad": ad, "site": rng.integers(0, 30, rows)})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)  # fewer rows than a row group holds: one row group, as pandas writes
    return path


RANK_SCRIPT = r"""
import json, sys
import lightning.pytorch as pl
from ctr_lightning.datamodules import ParquetDataModule
from ctr_lightning.models import DLRMModule

train, val = sys.argv[2], sys.argv[3]
pl.seed_everything(0)
dm = ParquetDataModule(train_paths=[train], val_paths=[val], label_column="click", dense_columns=["price"],
                       categorical_columns=["ad", "site"], batch_size=64)
model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, num_dense_features=1, num_embeddings=1000,
                   embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[8, 1], sparse_learning_rate=0.1)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, datamodule=dm)
print("RESULT " + json.dumps({"steps": trainer.global_step, "auc": float(trainer.callback_metrics["val/auc"]),
                              "held_back": dm._train_loader.held_back[1]}), flush=True)
import torch.distributed as _dist
if _dist.is_initialized():
    _dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_parquet_file_of_one_row_group_trains_on_two_ranks(tmp_path, run_ranks):
    train = write_day(tmp_path / "train.parquet", 3000, 0)
    val = write_day(tmp_path / "val.parquet", 1000, 1)
    assert pq.ParquetFile(train).num_row_groups == 1
    results = run_ranks(RANK_SCRIPT, [str(train), str(val)], world=2)
    # 1,500 rows a rank in batches of 64: 24 steps, nothing dropped, a validation metric.
    assert [r["steps"] for r in results] == [24, 24]
    assert [r["held_back"] for r in results] == [0, 0]
    assert results[0]["auc"] == results[1]["auc"] > 0.6


def test_hive_day_partitions_train_online_in_date_order(tmp_path):
    days = {"2026-12-02": 2, "2026-12-01": 1, "2026-12-03": 1}
    written = {day: [write_day(tmp_path / "logs" / f"dt={day}" / f"part-{k}.parquet", 300, k)
                     for k in range(parts)] for day, parts in days.items()}
    seen = []

    class Record(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            seen.append((trainer.datamodule.epoch_files["train"], trainer.datamodule.epoch_files["val"]))

    dm = ParquetDataModule(train_paths=str(tmp_path / "logs"), label_column="click", dense_columns=["price"],
                           categorical_columns=["ad", "site"], batch_size=100, online=True)
    model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, num_dense_features=1, num_embeddings=1000,
                       embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[8, 1])
    pl.Trainer(max_epochs=2, reload_dataloaders_every_n_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
               callbacks=[Record()]).fit(model, datamodule=dm)
    day = {d: [str(p) for p in paths] for d, paths in written.items()}
    assert seen == [(day["2026-12-01"], day["2026-12-02"]), (day["2026-12-02"], day["2026-12-03"])]


def test_a_group_column_reports_gauc_over_the_files_users(tmp_path):
    rng = np.random.default_rng(3)
    rows = 2000
    user = rng.choice([f"u{k}" for k in range(40)], rows)
    ad = rng.integers(0, 200, rows)
    click = (rng.random(rows) < 0.1 + 0.6 * (ad % 2)).astype(np.int64)
    path = tmp_path / "val.parquet"
    pq.write_table(pa.table({"click": click, "price": rng.random(rows), "ad": ad, "user": user}), path,
                   row_group_size=700)
    dm = ParquetDataModule(train_paths=[str(path)], val_paths=[str(path)], label_column="click",
                           dense_columns=["price"], categorical_columns=["ad"], group_column="user", batch_size=128)
    model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, num_dense_features=1, num_embeddings=1000,
                       embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[8, 1],
                       sparse_learning_rate=0.1)
    trainer = pl.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    logged = float(trainer.callback_metrics["val/gauc"])
    # The same metric over the file's own user strings and the model's scores, in file order.
    import torch

    from ctr_lightning.metrics import group_auc

    model.eval()
    scores = []
    with torch.no_grad():
        for batch in dm.val_dataloader():
            assert batch.groups is not None and len(batch.groups) == len(batch)
            scores.append(model(batch))
    users = torch.tensor([int(u[1:]) for u in user])
    expected = float(group_auc(torch.cat(scores).double(), torch.from_numpy(click).bool(), users))
    assert logged == pytest.approx(expected, abs=1e-6)
    assert logged > 0.6  # the ad decides the click, within every user
