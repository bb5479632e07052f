from lightning.pytorch import Trainer

from ctr_lightning.callbacks import StreamProgressBar
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.models import DeepFMModule


def test_training_bar_has_the_epochs_total(tmp_path):
    data = write_synthetic_criteo(tmp_path / "a.tsv", rows=1000, seed=3, max_cardinality=1000)
    dm = CriteoDataModule(train_paths=[str(data)], val_paths=[str(data)], batch_size=128)
    model = DeepFMModule(embedding_dim=4, num_embeddings=1000, deep_layer_sizes=[8])
    bar = StreamProgressBar()
    fit = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
                  callbacks=[bar], max_epochs=1, num_sanity_val_steps=0)
    fit.fit(model, datamodule=dm)
    assert bar.train_progress_bar.total == 8 == bar.train_progress_bar.n
    assert bar.val_progress_bar.total == 8
    capped = StreamProgressBar()
    Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
            callbacks=[capped], max_steps=3, limit_val_batches=0).fit(model, datamodule=dm)
    assert capped.train_progress_bar.total == 3
    accumulating = StreamProgressBar()  # 3 optimizer steps of 2 batches each: 6 batches
    Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
            callbacks=[accumulating], max_steps=3, accumulate_grad_batches=2, limit_val_batches=0).fit(
        model, datamodule=dm)
    assert accumulating.train_progress_bar.total == 6 == accumulating.train_progress_bar.n


def test_a_run_that_ends_at_its_ssd_size_counts_gib_and_its_summary_names_the_files(tmp_path, caplog):
    import logging

    from ctr_lightning.callbacks import RunSummary, StorageMonitor
    from ctr_lightning.embedding import StorageConfig
    from ctr_lightning.models import DLRMModule

    data = write_synthetic_criteo(tmp_path / "a.tsv", rows=2000, seed=3, max_cardinality=5000)
    dm = CriteoDataModule(train_paths=[str(data)], batch_size=100)
    ssd = tmp_path / "ssd"
    model = DLRMModule(embedding_dim=4, num_embeddings=5000, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1],
                       storage=StorageConfig(device_rows=256, host_rows=0, ssd_dir=str(ssd), ssd_segment_bytes=4096))
    bar = StreamProgressBar()
    target = 60_000
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
                      max_epochs=1, callbacks=[bar, StorageMonitor(every_n_steps=1, stop_at_ssd_bytes=target,
                                                                   slack_bytes=0), RunSummary()])
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step < 20  # stopped at the SSD size, before the data's end
    # The bar showed the nearer end: GiB of rows on SSD against the target.
    assert bar.train_progress_bar.unit == "GiB" and bar.train_progress_bar.total == float(f"{target / 2**30:.3g}")
    assert bar.train_progress_bar.n == bar.train_progress_bar.total
    size = sum(p.stat().st_size for p in ssd.rglob("*") if p.is_file())
    assert size > 0 and f"SSD files:  {ssd} ({size / 2**30:.2f} GiB" in caplog.text
