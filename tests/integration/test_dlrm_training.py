import lightning.pytorch as pl
import pytest
import torch

from ctr_lightning.datamodules import CriteoDataModule
from ctr_lightning.models import DLRMModule


def _fit(tmp_path, train, val, **trainer_kwargs):
    pl.seed_everything(0)
    model = DLRMModule(embedding_dim=8, num_embeddings=20_000, dense_arch_layer_sizes=[32],
                       over_arch_layer_sizes=[32, 1], learning_rate=3e-3, sparse_learning_rate=0.05)
    dm = CriteoDataModule(train_paths=[str(train)], val_paths=[str(val)], batch_size=128)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, **trainer_kwargs)
    trainer.fit(model, datamodule=dm)
    return trainer, model, dm


def test_short_training_on_real_sample_beats_chance(real_criteo, tmp_path):
    # Train on one sample file, score the other: rows the model never saw.
    trainer, _, _ = _fit(tmp_path, real_criteo.big, real_criteo.head, max_epochs=1)
    auc = trainer.callback_metrics["val/auc"].item()
    assert auc > 0.6, auc
    assert 0.0 < trainer.callback_metrics["val/ne"].item() < 1.0
    # A trained model predicts about as many clicks as there are (PCOC near 1).
    assert 0.5 < trainer.callback_metrics["val/calibration"].item() < 2.0


def test_checkpoint_round_trip_restores_tables(criteo_sample, tmp_path):
    trainer, model, dm = _fit(tmp_path, criteo_sample.head, criteo_sample.head, max_steps=5)
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    restored = DLRMModule.load_from_checkpoint(path)
    state = model.embeddings.get_extra_state()["tables"]
    for name in model.hparams.sparse_feature_names[:5]:
        ids = state[f"t_{name}"]["ids"][:50]
        assert len(ids) > 0
        torch.testing.assert_close(model.embeddings.rows(f"t_{name}", ids),
                                   restored.embeddings.rows(f"t_{name}", ids))
    batch = next(iter(dm.val_dataloader()))
    model.eval()
    restored.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(batch), restored(batch))


def _auc(scores, labels):
    """Mann-Whitney AUC with ties counted half, in numpy: independent of torchmetrics."""
    import numpy as np

    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    pos, neg = scores[labels == 1], scores[labels == 0]
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return greater / (len(pos) * len(neg))


def test_test_and_predict_stream_their_own_files(tmp_path):
    from ctr_lightning.datamodules import write_synthetic_criteo

    train = write_synthetic_criteo(tmp_path / "train.tsv", rows=3000, seed=0)
    held_out = write_synthetic_criteo(tmp_path / "test.tsv", rows=900, seed=0, stream=1)
    unseen = write_synthetic_criteo(tmp_path / "predict.tsv", rows=700, seed=0, stream=2)
    pl.seed_everything(0)
    model = DLRMModule(embedding_dim=8, num_embeddings=20_000, dense_arch_layer_sizes=[16],
                       over_arch_layer_sizes=[16, 1], learning_rate=3e-3, sparse_learning_rate=0.05)
    dm = CriteoDataModule(train_paths=[str(train)], test_paths=[str(held_out)], predict_paths=[str(unseen)],
                          batch_size=128)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    (metrics,) = trainer.test(model, datamodule=dm)

    def plain_loop(path):
        scores, labels = [], []
        model.eval()
        with torch.no_grad():
            for batch in CriteoDataModule(train_paths=[str(path)], batch_size=100).train_dataloader():
                scores.append(torch.sigmoid(model(batch)))
                labels.append(batch.labels)
        return torch.cat(scores), torch.cat(labels)

    scores, labels = plain_loop(held_out)
    assert len(scores) == 900
    assert metrics["test/auc"] == pytest.approx(_auc(scores.numpy(), labels.numpy()), abs=1e-5)
    assert metrics["test/auc"] > 0.6
    logloss = torch.nn.functional.binary_cross_entropy(scores.double(), labels.double()).item()
    assert metrics["test/logloss"] == pytest.approx(logloss, rel=1e-4)

    predictions = torch.cat(trainer.predict(model, datamodule=dm))
    want, _ = plain_loop(unseen)
    assert predictions.shape == (700,)
    torch.testing.assert_close(predictions, want)  # in file order, one score per row
