import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ctr_lightning.callbacks import ProgressiveValidation
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.datamodules.sources import slice_event_time
from ctr_lightning.models import DLRMModule


class TrainLosses(pl.Callback):
    """Each training batch's loss and size: the same forward's scores, averaged per batch."""

    def __init__(self):
        self.per_epoch = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.per_epoch.setdefault(trainer.current_epoch, []).append((float(loss), len(batch)))


def test_each_slice_is_scored_by_the_training_forward_before_its_update(tmp_path):
    for d in range(3):
        part = tmp_path / "logs" / f"dt=2026-12-0{d + 1}" / "hour=05"
        part.mkdir(parents=True)
        write_synthetic_criteo(part / "part-0.tsv", rows=500, seed=0, stream=d)
    progressive, losses = ProgressiveValidation(), TrainLosses()
    logger = TensorBoardLogger(tmp_path / "tb", name="", version="")
    forwards = []
    module = DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    module.register_forward_hook(lambda m, a, o: forwards.append(m.training))
    trainer = pl.Trainer(max_epochs=2, reload_dataloaders_every_n_epochs=1, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[progressive, losses])
    trainer.fit(module, datamodule=CriteoDataModule(train_paths=str(tmp_path / "logs/dt=*/hour=*/*.tsv"),
                                                    batch_size=100, online=True))
    assert forwards == [True] * 10  # one forward a batch: the scores are the training forward's own
    assert [h["slice"] for h in progressive.history] == [0, 1]
    for h in progressive.history:
        # Log loss over a slice = the batch-size-weighted mean of its batches' training losses.
        per_batch = np.array(losses.per_epoch[h["slice"]])
        expected = float((per_batch[:, 0] * per_batch[:, 1]).sum() / per_batch[:, 1].sum())
        assert h["online/logloss"] == pytest.approx(expected, rel=1e-5)
        assert 0.0 < h["online/auc"] < 1.0 and h["online/calibration"] > 0
        day = h["slice"] + 1
        assert h["name"].endswith(f"logs/dt=2026-12-0{day}/hour=05")
        assert h["event_time"] == slice_event_time([f"dt=2026-12-0{day}/hour=05/x"]) == 1796083200 + (day - 1) * 86400 + 5 * 3600
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag in ("online/auc", "online/logloss", "online/calibration"):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [0, 1]
        assert [s.wall_time for s in scalars] == [h["event_time"] for h in progressive.history]
        assert [s.value for s in scalars] == pytest.approx([h[tag] for h in progressive.history], rel=1e-6)
