"""Predict, validation and GAUC over two gloo ranks on 127.0.0.1: every record scored once,
in one file per rank, and validated once, when the ranks' shares differ by a batch; a
group whose examples sit on both ranks counts as one group."""

import pytest

RANK_SCRIPT = r"""
import json, sys
import lightning.pytorch as pl
import torch
from ctr_lightning.callbacks import ScoreWriter
from ctr_lightning.datamodules import CriteoDataModule
from ctr_lightning.metrics import GroupAUC
from ctr_lightning.models import DeepFMModule

data, out = sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = DeepFMModule(embedding_dim=4, num_embeddings=1000, deep_layer_sizes=[8])
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[ScoreWriter(out, file_format="parquet")])
trainer.predict(model, datamodule=CriteoDataModule(predict_paths=[data], batch_size=128), return_predictions=False)
# Validation over the same records: the rank with fewer pads too, so every record counts.
[val] = trainer.validate(model, datamodule=CriteoDataModule(val_paths=[data], batch_size=128), verbose=False)

# GAUC synced over the ranks: rank r holds half of every group's examples.
metric = GroupAUC()
g = torch.Generator().manual_seed(1)
scores, labels = torch.rand(400, generator=g), torch.rand(400, generator=g) < 0.4
groups = torch.arange(400) % 7
mine = torch.arange(400) % 2 == trainer.global_rank
metric.update(scores[mine], labels[mine].float(), groups[mine])
print("RESULT " + json.dumps({"rank": trainer.global_rank, "gauc": float(metric.compute()),
                              "val_logloss": val["val/logloss"], "val_loss": val["val/loss"]}), flush=True)
import torch.distributed as _dist
if _dist.is_initialized():
    _dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_score_and_validate_every_record_once_and_sync_gauc(tmp_path, run_ranks):
    import pyarrow.parquet as pq
    import torch

    from ctr_lightning.datamodules import write_synthetic_criteo
    from ctr_lightning.metrics import group_auc

    # 1,025 records: 513 for rank 0 (5 batches of 128), 512 for rank 1 (4): rank 1 pads one empty batch.
    data = write_synthetic_criteo(tmp_path / "day.tsv", rows=1025, seed=3, max_cardinality=1000)
    results = run_ranks(RANK_SCRIPT, [str(data), str(tmp_path / "scores")], world=2)
    files = sorted((tmp_path / "scores").glob("*.parquet"))
    assert [f.name for f in files] == ["scores-rank00000.parquet", "scores-rank00001.parquet"]
    rows = [pq.read_table(f).column("row").to_pylist() for f in files]
    assert [len(r) for r in rows] == [513, 512]
    assert sorted(rows[0] + rows[1]) == list(range(1025))
    labels = [line.split("\t")[0] for line in data.read_text().splitlines()]
    for f in files:
        table = pq.read_table(f).to_pydict()
        assert [float(labels[r]) for r in table["row"]] == table["label"]
        assert all(0.0 < s < 1.0 for s in table["score"])

    # Validation's log loss is the scored records' own: all 1,025 of them, none held back.
    both = [pq.read_table(f).to_pydict() for f in files]
    p = torch.tensor(both[0]["score"] + both[1]["score"], dtype=torch.float64)
    y = torch.tensor(both[0]["label"] + both[1]["label"], dtype=torch.float64)
    logloss = float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
    assert [r["val_logloss"] for r in results] == pytest.approx([logloss, logloss], rel=1e-5)
    assert [r["val_loss"] for r in results] == pytest.approx([logloss, logloss], rel=1e-5)

    g = torch.Generator().manual_seed(1)
    scores, flags = torch.rand(400, generator=g), torch.rand(400, generator=g) < 0.4
    whole = float(group_auc(scores.double(), flags, torch.arange(400) % 7))
    assert [r["gauc"] for r in results] == pytest.approx([whole, whole], abs=1e-6)
