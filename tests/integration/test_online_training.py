
import pytest

from ctr_lightning.datamodules import CriteoDataModule


def test_online_mode_trains_on_each_day_and_validates_on_the_next(tmp_path):
    import lightning.pytorch as pl

    from ctr_lightning.datamodules import write_synthetic_criteo
    from ctr_lightning.models import DLRMModule

    days = [write_synthetic_criteo(tmp_path / f"day_{d}.tsv", rows=600, seed=0, stream=d) for d in range(3)]
    seen = []

    class Record(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            dm = trainer.datamodule
            seen.append((dm.epoch_files["train"], dm.epoch_files["val"]))

    dm = CriteoDataModule(train_paths=str(tmp_path / "day_*.tsv"), batch_size=200, online=True)
    trainer = pl.Trainer(max_epochs=2, reload_dataloaders_every_n_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[Record()])
    trainer.fit(DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4],
                           over_arch_layer_sizes=[4, 1]), datamodule=dm)
    assert seen == [([str(days[0])], [str(days[1])]), ([str(days[1])], [str(days[2])])]
    with pytest.raises(ValueError, match="reload_dataloaders_every_n_epochs=1"):
        pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False).fit(
            DLRMModule(num_embeddings=10, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1]),
            datamodule=CriteoDataModule(train_paths=str(tmp_path / "day_*.tsv"), online=True))
