"""Tables with an SSD tier are checkpointed through table snapshots by default: a plain
ModelCheckpoint, no TableSnapshots given, never gathers them into the ``.ckpt``. Tables in
memory keep their rows in it, and a TableSnapshots or whole rows asked for are left as set."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.callbacks import TableSnapshots, table_snapshots_by_default
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.embedding import GatheringSsdRowsError, SparseSGD, StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.models import DLRMModule

from .test_damaged_and_moved_checkpoints import rows_of

EVERY = 4


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "day_0.tsv"
    write_synthetic_criteo(path, rows=2 * EVERY * 64 + 200, seed=0)
    return path


def dlrm(storage: StorageConfig | None) -> DLRMModule:
    return DLRMModule(embedding_dim=8, num_embeddings=5000, dense_arch_layer_sizes=[16], over_arch_layer_sizes=[16, 1],
                      storage=storage)


def fit(module: pl.LightningModule, work: Path, data: Path, max_steps: int, callbacks: list | None = None,
        ckpt_path: Path | None = None) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=work,
                         callbacks=[ModelCheckpoint(dirpath=work / "ckpt", every_n_train_steps=EVERY, save_last=True),
                                    *(callbacks or [])])
    trainer.fit(module, datamodule=CriteoDataModule(train_paths=[str(data)], batch_size=64),
                ckpt_path=str(ckpt_path) if ckpt_path else None)
    return trainer


def extra_states(ckpt: Path) -> list[dict]:
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    return [v for k, v in state.items() if k.endswith("_extra_state")]


def test_a_plain_model_checkpoint_streams_ssd_tables_to_a_snapshot_and_resumes(tmp_path, data):
    def ssd(name: str) -> StorageConfig:
        return StorageConfig(device_rows=150, host_rows=0, ssd_dir=str(tmp_path / name))

    pl.seed_everything(0)
    whole = dlrm(ssd("ssd_whole"))
    fit(whole, tmp_path / "whole", data, 2 * EVERY)
    pl.seed_everything(0)
    trainer = fit(dlrm(ssd("ssd_first")), tmp_path / "run", data, EVERY)
    [added] = [c for c in trainer.callbacks if isinstance(c, TableSnapshots)]
    # Lightning orders it before the ModelCheckpoint, which saves last.
    assert trainer.callbacks.index(added) < trainer.callbacks.index(trainer.checkpoint_callback)
    last = tmp_path / "run" / "ckpt" / "last.ckpt"
    states = extra_states(last)
    assert states and all(set(s) == {"snapshot", "manifest_sha256"} for s in states)  # no rows in the .ckpt
    assert Path(states[0]["snapshot"]).parent == tmp_path / "run" / "ckpt" / "table_snapshots"

    pl.seed_everything(0)
    resumed = dlrm(ssd("ssd_resumed"))
    fit(resumed, tmp_path / "run", data, 2 * EVERY, ckpt_path=last)
    want, got = rows_of(whole), rows_of(resumed)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name][0], got[name][0]) and torch.equal(want[name][1], got[name][1]), name


@pytest.mark.parametrize("case", ["in_memory", "own_table_snapshots", "whole_rows_asked"])
def test_other_choices_are_left_as_they_are(tmp_path, data, case):
    module = dlrm(None if case == "in_memory" else StorageConfig(device_rows=150, host_rows=0,
                                                                  ssd_dir=str(tmp_path / "ssd")))
    own = [TableSnapshots(full_every=1)] if case == "own_table_snapshots" else []
    if case == "whole_rows_asked":
        module.embeddings.checkpoint_to_snapshots(None)
    trainer = fit(module, tmp_path, data, EVERY, callbacks=own)
    assert [c for c in trainer.callbacks if isinstance(c, TableSnapshots)] == own
    states = extra_states(tmp_path / "ckpt" / "last.ckpt")
    assert all(("snapshot" in s) == (case == "own_table_snapshots") for s in states)


class OwnModel(pl.LightningModule):
    """A user's own LightningModule holding a tiered collection with an SSD tier."""

    def __init__(self, ssd_dir: str, snapshots_by_default: bool) -> None:
        super().__init__()
        self.tables = TieredEmbeddingBagCollection(
            [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=1000, feature_names=["f0"])],
            storage=StorageConfig(device_rows=10, host_rows=0, ssd_dir=ssd_dir), optimizer=SparseSGD(lr=0.1))
        self.scale = nn.Parameter(torch.ones(1))
        self.snapshots_by_default = snapshots_by_default

    def training_step(self, features: KeyedJaggedTensor, batch_idx: int) -> torch.Tensor:
        return (self.tables(features).values() * self.scale).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.scale], lr=0.01)

    def configure_callbacks(self) -> list[pl.Callback]:
        return table_snapshots_by_default(self) if self.snapshots_by_default else []


@pytest.mark.parametrize("snapshots_by_default", [True, False], ids=["configure_callbacks", "plain"])
def test_a_users_own_module_gets_snapshots_from_configure_callbacks_or_is_refused(tmp_path, snapshots_by_default):
    batches = [KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.arange(8) + 8 * step,
                                                   lengths=torch.ones(8, dtype=torch.int32)) for step in range(4)]
    module = OwnModel(str(tmp_path / "ssd"), snapshots_by_default)
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)])
    if snapshots_by_default:
        trainer.fit(module, DataLoader(batches, batch_size=None))
        [state] = extra_states(next((tmp_path / "ckpt").glob("*.ckpt")))
        assert "snapshot" in state
    else:
        # Refused at the first save, before any row is gathered: no .ckpt is written.
        with pytest.raises(GatheringSsdRowsError, match=r"tables \['t0'\] would gather into memory every row their "
                                                        r"SSD tier holds.*TableSnapshots\(\)"):
            trainer.fit(module, DataLoader(batches, batch_size=None))
        assert not list((tmp_path / "ckpt").glob("*.ckpt"))
        module.tables.checkpoint_to_snapshots(None)  # whole rows, asked for
        assert set(module.tables.state_dict()["_extra_state"]["tables"]) == {"t0"}
