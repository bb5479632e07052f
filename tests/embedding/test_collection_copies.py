"""Copying a collection (collection_copies.py): deepcopy / pickle / torch.save share nothing
mutable, or are refused clearly where an SSD tier would be shared."""

import copy
import io
import pickle

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from torch import nn

from ctr_lightning.embedding import AutoStorage, SparseAdam, SparseSGD, StorageConfig, TieredEmbeddingBagCollection

from .test_torchrec_state import LR, ROWS, batch, sgd_step, tables

COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": lambda m: torch.load(io.BytesIO(_saved(m)), weights_only=False),
}


def _saved(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_of_an_in_memory_collection_shares_nothing_mutable(how):
    original = TieredEmbeddingBagCollection(tables(), storage=StorageConfig(device_rows=150), optimizer=SparseAdam())
    for step in range(3):
        sgd_step(original, batch(step))
    ids = torch.arange(ROWS)
    before = {name: original.rows(name, ids) for name in ("a", "b")}
    copied = COPIES[how](original)
    assert all(torch.equal(copied.rows(name, ids), before[name]) for name in before)
    for step in range(3, 6):
        sgd_step(copied, batch(step))
    assert all(torch.equal(original.rows(name, ids), before[name]) for name in before)  # the original untouched
    assert not torch.equal(copied.rows("a", ids), before["a"])
    sgd_step(original, batch(3))  # and the original trains on its own
    assert not torch.equal(original.rows("a", ids), copied.rows("a", ids))


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no errors from a half-made copy
@pytest.mark.parametrize("how", list(COPIES))
def test_a_collection_with_an_ssd_tier_refuses_to_be_copied_naming_it_and_the_way_out(tmp_path, how):
    ssd = str(tmp_path / "ssd")
    ebc = TieredEmbeddingBagCollection(tables(), storage=StorageConfig(device_rows=40, host_rows=0, ssd_dir=ssd))
    # Before its tiers are built (a copy built later would wipe the same directory) and after.
    for step in range(2):
        with pytest.raises(TypeError, match=rf"cannot be copied .*SSD tier in \['{ssd}'\].*save_tables"):
            COPIES[how](nn.Sequential(ebc))
        sgd_step(ebc, batch(step, size=8))
    ssd_log = ebc._built().groups[0].tiers.ssd
    with pytest.raises(TypeError, match=r"SsdLog of tables .* cannot be copied"):
        copy.deepcopy(ssd_log)
    sgd_step(ebc, batch(2, size=8))  # still trains


def test_copies_made_before_storage_auto_planned_never_share_an_ssd_directory(tmp_path):
    # Planned at the first use: a copy made before then is planned like the original.
    from ctr_lightning.topology import place_tables

    original = TieredEmbeddingBagCollection(tables(), storage=AutoStorage(ssd_dirs=(str(tmp_path),), reserve_bytes=0),
                                            placer=place_tables)
    copied = copy.deepcopy(original)
    assert copied.ssd_directories == [str(tmp_path)]  # the first to be planned keeps its SSD tier
    sgd_step(copied, batch(0))
    with pytest.raises(TypeError, match=rf"planned an SSD tier in \['{tmp_path}'\], where a copy .* corrupt"):
        original.ssd_directories
    with pytest.raises(TypeError, match=r"cannot be copied .*SSD tier"):
        copy.deepcopy(copied)  # planned: an SSD tier like any other


class TablesAndDense(pl.LightningModule):
    def __init__(self, storage=None):
        super().__init__()
        self.tables = TieredEmbeddingBagCollection(tables(), storage=storage, optimizer=SparseSGD(lr=LR))
        self.dense = nn.Linear(12, 1)

    def training_step(self, batch, batch_idx):
        kjt, target = batch
        return nn.functional.mse_loss(self.dense(self.tables(kjt).values()).squeeze(1), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.dense.parameters(), lr=LR)

    def train_dataloader(self):
        data = [(batch(i, size=8), torch.randn(8)) for i in range(4)]
        return torch.utils.data.DataLoader(data, batch_size=None)


@pytest.mark.parametrize("callback", [lambda: StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1),
                                      lambda: EMAWeightAveraging(decay=0.9)], ids=["swa", "ema"])
def test_lightning_callbacks_that_deep_copy_the_model(tmp_path, callback):
    def trainer():
        return pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=[callback()],
                          default_root_dir=tmp_path)

    model = TablesAndDense()
    untrained = model.tables.rows("a", torch.arange(ROWS))
    trainer().fit(model)
    assert not torch.equal(model.tables.rows("a", torch.arange(ROWS)), untrained)  # the tables trained

    ssd = str(tmp_path / "ssd")
    with pytest.raises(TypeError, match=rf"SSD tier in \['{ssd}'\].*StochasticWeightAveraging, EMA"):
        trainer().fit(TablesAndDense(StorageConfig(device_rows=40, host_rows=0, ssd_dir=ssd)))
