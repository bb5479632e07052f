import types

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ctr_lightning.callbacks import ExamplesPerSecond
from ctr_lightning.callbacks import examples_per_second


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.rates = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        rate = self.trainer.callback_metrics.get("train/examples_per_sec")
        self.rates.append(None if rate is None else float(rate))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_rate_is_examples_over_the_window_after_the_first_step(monkeypatch):
    # A clock that advances 0.5 s per reading: each step takes exactly half a second.
    ticks = iter(range(1000))
    monkeypatch.setattr(examples_per_second, "time", types.SimpleNamespace(perf_counter=lambda: 0.5 * next(ticks)))
    # 7 batches of 10 examples, then one of 3.
    loader = DataLoader(TensorDataset(torch.zeros(73, 2)), batch_size=10)
    model = Tiny()
    meter = ExamplesPerSecond(window=2)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[meter])
    trainer.fit(model, loader)
    # Callbacks' hooks run before the model's: each step sees its own rate. Step 1 has no
    # interval yet; then 10 examples per 0.5 s, over windows of up to 2 intervals; the
    # last window holds a batch of 10 and one of 3.
    assert model.rates == [None] + [20.0] * 6 + [(10 + 3) / 1.0]


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        ExamplesPerSecond(window=0)
