import os
import threading

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.callbacks import AutoPlacement, TableSnapshots
from ctr_lightning.datamodules import SyntheticStreamDataModule
from ctr_lightning.embedding import AutoStorage, StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.models import DLRMModule
from ctr_lightning.topology.auto_placement import set_threads


@pytest.fixture
def cpus_restored():
    """The callback pins this process (and its thread counts) to the plan: undone after the test."""
    import numba

    before = os.sched_getaffinity(0), torch.get_num_threads(), numba.get_num_threads()
    yield
    os.sched_setaffinity(0, before[0])
    set_threads(before[1])
    numba.set_num_threads(before[2])


def _data(batch_size=64, val_batches=0):
    return SyntheticStreamDataModule(num_sparse=2, num_dense=3, batch_size=batch_size, train_batches=4,
                                     val_batches=val_batches, head_size=500, num_workers=0)


class TablesAndDense(pl.LightningModule):
    """A LightningModule of its own (no CTRModule): the callback is given to the trainer."""

    def __init__(self, features, storage):
        super().__init__()
        self.tables = TieredEmbeddingBagCollection(
            [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=2000, feature_names=[f])
             for f in features], storage=storage)
        self.dense = nn.Linear(3 + 4 * len(features), 1)

    def training_step(self, batch, batch_idx):
        x = torch.cat([batch.dense, self.tables(batch.sparse).values()], 1)
        return F.binary_cross_entropy_with_logits(self.dense(x).squeeze(1), batch.labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.dense.parameters(), lr=0.1)


def test_plans_with_the_data_before_the_first_step_pins_the_cpus_and_logs_the_plan(tmp_path, cpus_restored):
    dm = _data()
    ssd = str(tmp_path / "ssd")
    model = TablesAndDense(dm.sparse_feature_names, AutoStorage(ssd_dirs=(ssd,), reserve_bytes=0, profile_batches=2))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[AutoPlacement()],
                         logger=TensorBoardLogger(str(tmp_path / "runs"), name="", version=""))
    # A thread started before the fit, on one CPU, and one compute thread: both change when it pins.
    started, finish, thread_id = threading.Event(), threading.Event(), []

    def on_one_cpu():
        thread_id.append(threading.get_native_id())
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread alone
        started.set()
        finish.wait()

    helper = threading.Thread(target=on_one_cpu)
    helper.start()
    started.wait()
    set_threads(1)
    try:
        trainer.fit(model, datamodule=dm)
        helper_cpus = os.sched_getaffinity(thread_id[0])
    finally:
        finish.set()
        helper.join()
    placement = model.tables.placement
    assert trainer.global_step == 2 and placement.plan.examples_per_step == 64  # the DataModule's batch
    assert model.tables.ssd_directories == [ssd]
    cpus = set(placement.rank.cpus)
    assert cpus and os.sched_getaffinity(0) == helper_cpus == cpus and torch.get_num_threads() == len(cpus)
    events = EventAccumulator(str(tmp_path / "runs"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("placement_plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "estimated step" in text and all(f"t_{f}" in text for f in dm.sparse_feature_names) and ssd in text


def test_a_ctr_module_adds_one_under_storage_auto_unless_the_trainer_has_one(tmp_path):
    def callbacks(storage, given):
        model = DLRMModule(sparse_feature_names=["a", "b"], num_dense_features=3, embedding_dim=4,
                           dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1], storage=storage)
        model.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=given)
        return [type(c) for c in model.configure_callbacks()]

    auto = AutoStorage(ssd_dirs=(str(tmp_path),))
    assert callbacks(auto, []) == [AutoPlacement]
    assert callbacks(auto, [AutoPlacement()]) == []  # the trainer's own, with its place in the order
    assert callbacks(StorageConfig(), []) == callbacks(None, []) == []


def test_validate_alone_plans_storage_auto_through_the_default_callback(tmp_path, cpus_restored):
    # No fit: the tiers are planned when validation starts (a collection without a placer would refuse to build).
    dm = _data(batch_size=32, val_batches=1)
    model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, num_dense_features=3, embedding_dim=4,
                       num_embeddings=2000, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1],
                       storage=AutoStorage(ssd_dirs=(str(tmp_path / "ssd"),), reserve_bytes=0))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    [metrics] = trainer.validate(model, datamodule=dm)
    assert "val/auc" in metrics and model.embeddings.placement.plan.examples_per_step == 32
    assert not any(isinstance(c, TableSnapshots) for c in trainer.callbacks)  # validate never checkpoints
