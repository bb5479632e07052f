import lightning.pytorch as pl
import torch

from ctr_lightning.callbacks import WorkingSetPrefetch
from ctr_lightning.datamodules import CriteoDataModule
from ctr_lightning.embedding import StorageConfig
from ctr_lightning.models import DLRMModule


def _fit(criteo_sample, ssd_dir, callbacks):
    pl.seed_everything(0)
    model = DLRMModule(embedding_dim=8, num_embeddings=20_000, dense_arch_layer_sizes=[16],
                       over_arch_layer_sizes=[16, 1], sparse_learning_rate=0.05,
                       storage=StorageConfig(device_rows=400, host_rows=0, ssd_dir=str(ssd_dir)))
    dm = CriteoDataModule(train_paths=[str(criteo_sample / "train_random4584.tsv")], batch_size=128, num_workers=1)
    logged = []

    class Capture(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("prefetch/")})

    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         callbacks=[*callbacks, Capture()])
    trainer.fit(model, datamodule=dm)
    return model, logged


def test_prefetch_in_a_fit_changes_nothing_but_the_waiting(criteo_sample, tmp_path):
    plain, _ = _fit(criteo_sample, tmp_path / "plain", [])
    model, logged = _fit(criteo_sample, tmp_path / "prefetch", [WorkingSetPrefetch(lookahead=4)])
    stats = model.embeddings.tier_stats()
    assert stats["prefetch_hits"] > 0 and stats["ssd_hits"] < stats["prefetch_hits"]
    # Logged every step of both epochs (the loader is wrapped again after the first).
    assert len(logged) == 2 * 36 and set(logged[-1]) == {"prefetch/hit_rate", "prefetch/ssd_stall_ms",
                                                        "prefetch/bytes_read"}
    assert sum(step["prefetch/bytes_read"] for step in logged) == stats["prefetch_bytes"]
    for a, b in zip(plain.dense_parameters(), model.dense_parameters()):
        assert torch.equal(a, b)
    want, got = plain.embeddings.get_extra_state()["tables"], model.embeddings.get_extra_state()["tables"]
    for t in want:  # every trained row and its Adam state, bit for bit
        order_w, order_g = torch.argsort(want[t]["ids"]), torch.argsort(got[t]["ids"])
        assert torch.equal(want[t]["ids"][order_w], got[t]["ids"][order_g])
        assert torch.equal(want[t]["rows"][order_w], got[t]["rows"][order_g])
