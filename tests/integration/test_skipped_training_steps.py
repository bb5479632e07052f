"""A Lightning training_step that returns None skips its batch for free: with a device tier
too small to keep the rows of the skipped batches, the run equals one that never saw them."""

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import SparseAdam, StorageConfig, TieredEmbeddingBagCollection

BATCHES = 15
EXAMPLES = 16
SKIPPED = {b for b in range(BATCHES) if b % 3 == 2}
TABLES = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10**6, feature_names=["f0", "f1"])]


def make_batches() -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    batches = []
    for b in range(BATCHES):
        # Half the ids from a hot set every batch shares, half new to this batch: rows are
        # evicted to SSD and read back, and each batch pins about 40 rows of a 64-row tier.
        hot = torch.randint(0, 30, (EXAMPLES * 2,), generator=gen)
        new = 1000 * (b + 1) + torch.randint(0, 1000, (EXAMPLES * 2,), generator=gen)
        values = torch.where(torch.arange(EXAMPLES * 2) % 2 == 0, hot, new)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=values,
                                                  lengths=torch.ones(EXAMPLES * 2, dtype=torch.int32))
        batches.append((kjt, torch.randint(0, 2, (EXAMPLES,), generator=gen).float()))
    return batches


class TinyCTR(pl.LightningModule):
    def __init__(self, ssd_dir: str, skip: set[int]) -> None:
        super().__init__()
        self.embeddings = TieredEmbeddingBagCollection(
            TABLES, storage=StorageConfig(device_rows=64, host_rows=0, ssd_dir=ssd_dir),
            optimizer=SparseAdam(lr=0.05))
        self.head = nn.Linear(8, 1)
        self.skip = skip

    def training_step(self, batch: tuple[KeyedJaggedTensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        kjt, labels = batch
        loss = F.binary_cross_entropy_with_logits(self.head(self.embeddings(kjt).values()).squeeze(1), labels)
        if batch_idx in self.skip:
            return None  # Lightning's documented way to skip a batch: no backward, no step
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.head.parameters(), lr=0.01)


def fit(tmp_path, name: str, batches: list, skip: set[int]) -> TinyCTR:
    pl.seed_everything(0)
    model = TinyCTR(str(tmp_path / name), skip)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, DataLoader(batches, batch_size=None))
    return model


def test_steps_returning_none_equal_a_run_without_those_batches(tmp_path):
    batches = make_batches()
    skipping = fit(tmp_path, "skipping", batches, SKIPPED)
    reference = fit(tmp_path, "reference", [b for i, b in enumerate(batches) if i not in SKIPPED], set())
    ids = np.unique(np.concatenate([kjt.values().numpy() for kjt, _ in batches]))
    assert torch.equal(skipping.embeddings.rows("t0", ids), reference.embeddings.rows("t0", ids))
    for got, want in zip(skipping.head.parameters(), reference.head.parameters()):
        assert torch.equal(got, want)
    assert skipping.embeddings.tier_stats()["ssd_hits"] > 0  # rows left the 64-row tier and came back
