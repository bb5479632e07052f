"""Lightning's precision="16-mixed" scales the loss with a GradScaler; handed that scaler,
the tables train as under an unscaled loss (run on CPU with a CPU GradScaler; the CUDA
path is the same code)."""

import warnings

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseSGD, StorageConfig, TieredEmbeddingBagCollection

TABLES = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10**6, feature_names=["f0", "f1"])]


def make_batches(count: int = 12) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(count):
        lengths = torch.randint(1, 3, (2 * 32,), generator=gen)
        values = torch.randint(0, 300, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=values, lengths=lengths)
        out.append((kjt, torch.randint(0, 2, (32,), generator=gen).float()))
    return out


class TinyCTR(pl.LightningModule):
    def __init__(self, ssd_dir: str) -> None:
        super().__init__()
        self.embeddings = TieredEmbeddingBagCollection(
            TABLES, storage=StorageConfig(device_rows=200, host_rows=0, ssd_dir=ssd_dir), optimizer=SparseSGD(lr=0.5))
        self.head = nn.Linear(16, 1)

    def on_fit_start(self) -> None:
        # The scaler that scales the loss: the tables' update runs inside backward.
        self.embeddings.set_grad_scaler(self.trainer.precision_plugin.scaler)

    def training_step(self, batch: tuple[KeyedJaggedTensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        kjt, labels = batch
        return F.binary_cross_entropy_with_logits(self.head(self.embeddings(kjt).values()).squeeze(1), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def fit(tmp_path, name: str, scaler: torch.amp.GradScaler) -> TinyCTR:
    pl.seed_everything(0)
    model = TinyCTR(str(tmp_path / name))
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(make_batches(), batch_size=None))
    assert not [w for w in caught if "no GradScaler" in str(w.message)]  # the collection knows the scaler
    return model


def test_16_mixed_with_loss_scaling_trains_the_rows_as_without(tmp_path):
    scaled_with = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    scaled = fit(tmp_path, "scaled", scaled_with)
    unscaled = fit(tmp_path, "unscaled", torch.amp.GradScaler("cpu", enabled=False))
    assert scaled_with.get_scale() == 2.0**10  # no step overflowed: every step trained
    ids = np.arange(300)
    got, want = scaled.embeddings.rows("t0", ids), unscaled.embeddings.rows("t0", ids)
    # float16 gradients: scaling by a power of two is exact but for values float16 cannot hold unscaled.
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    moved = (want - fit_nothing(tmp_path).embeddings.rows("t0", ids)).abs().max()
    assert moved > 1e-3  # the rows did train (by far more than the tolerance)
    for g, w in zip(scaled.head.parameters(), unscaled.head.parameters()):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-5)


def fit_nothing(tmp_path) -> TinyCTR:
    pl.seed_everything(0)
    return TinyCTR(str(tmp_path / "untrained"))


def test_a_ctr_module_hands_lightnings_scaler_to_its_tables(tmp_path):
    # No code of the user's: CTRModule passes the precision plugin's scaler on at fit start.
    from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
    from ctr_lightning.models import DLRMModule

    data = write_synthetic_criteo(tmp_path / "day_0.tsv", rows=8 * 64, seed=0)

    def fit_dlrm(scaler: torch.amp.GradScaler) -> DLRMModule:
        pl.seed_everything(0)
        model = DLRMModule(embedding_dim=4, num_embeddings=1000, dense_arch_layer_sizes=[4],
                           over_arch_layer_sizes=[4, 1], sparse_optimizer="sgd", sparse_learning_rate=0.5)
        pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                   plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]).fit(
            model, datamodule=CriteoDataModule(train_paths=[str(data)], batch_size=64))
        return model

    scaled = fit_dlrm(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6))
    unscaled = fit_dlrm(torch.amp.GradScaler("cpu", enabled=False))
    dm = CriteoDataModule(train_paths=[str(data)], batch_size=64)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    untrained = DLRMModule(embedding_dim=4, num_embeddings=1000, dense_arch_layer_sizes=[4],
                           over_arch_layer_sizes=[4, 1])
    for table, feature in (("t_C1", "C1"), ("t_C2", "C2")):
        ids = batch.sparse[feature].values()  # trained ids (the readers hash the raw values)
        got, want = scaled.embeddings.rows(table, ids), unscaled.embeddings.rows(table, ids)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
        assert (want - untrained.embeddings.rows(table, ids)).abs().max() > 1e-4  # trained: beyond the tolerance
