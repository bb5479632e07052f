"""Follow mode in a real Trainer: slices taken as they land, resumed exactly from a checkpoint."""

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.models import DLRMModule


def land(root, hour, marker=True):
    part = root / "dt=2026-12-01" / f"hour={hour:02d}"
    part.mkdir(parents=True)
    write_synthetic_criteo(part / "part-0.tsv", rows=400, seed=0, stream=hour)
    if marker:
        (part / "_SUCCESS").write_text("")
    return str(part / "part-0.tsv")


class Seen(pl.Callback):
    """Each training batch's slice and a fingerprint of its examples."""

    def __init__(self, on_first_batch=None):
        self.batches, self.on_first_batch = [], on_first_batch

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        files = trainer.datamodule.epoch_files["train"]
        self.batches.append((files[0].rsplit("/", 2)[-2], round(float(batch.dense.sum()), 3), int(batch.labels.sum())))
        if self.on_first_batch is not None and len(self.batches) == 1:
            self.on_first_batch()


def model():
    return DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])


def fit(root, callbacks, ckpt_path=None, **trainer_args):
    trainer = pl.Trainer(reload_dataloaders_every_n_epochs=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, max_epochs=20, callbacks=callbacks,
                         **trainer_args)
    data = CriteoDataModule(train_paths=str(root), batch_size=100, follow=True, poll_seconds=0.05, idle_timeout=0.5)
    trainer.fit(model(), datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_a_slice_landing_during_training_is_trained_next_and_one_being_written_is_not(tmp_path):
    root = tmp_path / "logs"
    land(root, 0)
    seen = Seen(on_first_batch=lambda: (land(root, 1), land(root, 2, marker=False)))
    trainer = fit(root, [seen], enable_checkpointing=False)
    assert [b[0] for b in seen.batches] == ["hour=00"] * 4 + ["hour=01"] * 4  # hour 02 has no _SUCCESS
    assert trainer.global_step == 8 and trainer.should_stop  # ended by idle_timeout, after a whole slice


def test_a_resume_goes_on_at_the_batch_after_the_checkpoint_with_the_slices_it_had(tmp_path):
    root = tmp_path / "logs"
    for hour in (0, 1):
        land(root, hour)
    straight = Seen()
    fit(root, [straight], enable_checkpointing=False)
    first = Seen()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    fit(root, [first, checkpoints], max_steps=6)  # stops in the middle of hour 01
    second = Seen(on_first_batch=lambda: land(root, 2))  # a slice lands after the resume
    fit(root, [second], ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=6.ckpt"), enable_checkpointing=False)
    assert len(first.batches) == 6
    assert first.batches + second.batches[:2] == straight.batches  # nothing trained twice, nothing skipped
    assert [b[0] for b in second.batches[2:]] == ["hour=02"] * 4
