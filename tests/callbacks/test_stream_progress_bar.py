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
