import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ctr_lightning.callbacks import StorageMonitor
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.embedding import Admission, Expiry
from ctr_lightning.models import DLRMModule


def fit(tmp_path, **lifecycle) -> tuple[DLRMModule, StorageMonitor, EventAccumulator]:
    """6 steps of a small DLRM with a StorageMonitor logging every step to TensorBoard."""
    data = write_synthetic_criteo(tmp_path / "day.tsv", rows=600, seed=0)
    module = DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1],
                        **lifecycle)
    monitor = StorageMonitor(every_n_steps=1)
    trainer = pl.Trainer(max_steps=6, logger=TensorBoardLogger(tmp_path / "tb", name="", version=""),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, callbacks=[monitor])
    trainer.fit(module, datamodule=CriteoDataModule(train_paths=str(data), batch_size=100))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    return module, monitor, events


def test_admission_counts_per_table_reach_tensorboard(tmp_path):
    module, monitor, events = fit(tmp_path, admission=Admission(admit_after=2))
    counts = module.embeddings.admission_counts()
    assert set(counts) == {f"t_{name}" for name in module.sparse_feature_names}
    admitted = sum(c["admitted"] for c in counts.values())
    rejected = sum(c["rejected"] for c in counts.values())
    assert admitted > 0 and rejected > 0
    assert admitted == module.embeddings.tier_stats()["rows_admitted"]
    assert monitor.last["storage/rows_admitted"] == admitted and monitor.last["storage/rows_rejected"] == rejected
    # Every row stored was admitted (no rows before admission).
    assert monitor.last["storage/rows"] == admitted
    table = next(iter(counts))
    assert events.Scalars(f"storage/admitted/{table}")[-1].value == counts[table]["admitted"]
    assert events.Scalars("storage/rows_rejected")[-1].value == rejected
    # The sketch's counters in use: each id sighted took a counter in each of its rows.
    sketch = counts[table]
    assert 0 < sketch["counters_used"] < sketch["counters"]
    assert events.Scalars(f"storage/sketch_fill/{table}")[-1].value == pytest.approx(
        sketch["counters_used"] / sketch["counters"])


def test_expired_and_live_rows_per_table_reach_tensorboard(tmp_path):
    module, monitor, events = fit(tmp_path, expiry=Expiry(ttl=2))
    counts = module.embeddings.expiry_counts()
    assert set(counts) == {f"t_{name}" for name in module.sparse_feature_names}
    expired = sum(c["expired"] for c in counts.values())
    assert expired > 0 and monitor.last["storage/rows_expired"] == expired
    assert monitor.last["storage/rows_evicted"] == 0
    table = max(counts, key=lambda t: counts[t]["expired"])
    assert events.Scalars(f"storage/live_rows/{table}")[-1].value == counts[table]["rows"] > 0
    assert events.Scalars(f"storage/expired/{table}")[-1].value == counts[table]["expired"] > 0
    assert module.hparams["expiry"] == Expiry(ttl=2)


def test_a_show_click_cap_trains_through_the_module_with_its_labels(tmp_path):
    # CTRModule hands each batch's labels to the tables: a click-counting score works in a fit.
    module, monitor, events = fit(tmp_path, expiry=Expiry(max_rows=150, score="show_click", decay=0.9))
    counts = module.embeddings.expiry_counts()
    assert sum(c["evicted"] for c in counts.values()) > 0 and all(c["rows"] <= 150 for c in counts.values())
    assert monitor.last["storage/rows_evicted"] == sum(c["evicted"] for c in counts.values())
