import lightning.pytorch as pl
import pytest
import torch

from ctr_lightning.callbacks import WorkingSetPrefetch
from ctr_lightning.datamodules import CriteoDataModule, SyntheticCriteoDataModule
from ctr_lightning.embedding import StorageConfig
from ctr_lightning.models import DLRMModule


def _fit(criteo_sample, ssd_dir, callbacks):
    pl.seed_everything(0)
    model = DLRMModule(embedding_dim=8, num_embeddings=20_000, dense_arch_layer_sizes=[16],
                       over_arch_layer_sizes=[16, 1], sparse_learning_rate=0.05,
                       storage=StorageConfig(device_rows=400, host_rows=0, ssd_dir=str(ssd_dir)))
    dm = CriteoDataModule(train_paths=[str(criteo_sample.big)], batch_size=128, num_workers=1)
    logged = []

    class Capture(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("prefetch/")})

    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         callbacks=[*callbacks, Capture()])
    trainer.fit(model, datamodule=dm)
    return model, logged


def test_prefetch_in_a_fit_changes_nothing_but_the_waiting(criteo_sample, tmp_path):
    plain, _ = _fit(criteo_sample, tmp_path / "plain", [])
    model, logged = _fit(criteo_sample, tmp_path / "prefetch", [WorkingSetPrefetch(lookahead=4)])
    stats = model.embeddings.tier_stats()
    assert stats["prefetch_hits"] > 0 and stats["ssd_hits"] < stats["prefetch_hits"]
    # Logged every step of both epochs (the loader is wrapped again after the first).
    assert len(logged) == 2 * 36 and set(logged[-1]) == {"prefetch/hit_rate", "prefetch/ssd_stall_ms",
                                                        "prefetch/bytes_read"}
    assert sum(step["prefetch/bytes_read"] for step in logged) == stats["prefetch_bytes"]
    assert sum(step["prefetch/bytes_read"] for step in logged[:36]) > 0  # the first epoch reads ahead too
    for a, b in zip(plain.dense_parameters(), model.dense_parameters()):
        assert torch.equal(a, b)
    plain.embeddings.checkpoint_to_snapshots(None)  # whole rows, asked for
    model.embeddings.checkpoint_to_snapshots(None)
    want, got = plain.embeddings.get_extra_state()["tables"], model.embeddings.get_extra_state()["tables"]
    for t in want:  # every trained row and its Adam state, bit for bit
        order_w, order_g = torch.argsort(want[t]["ids"]), torch.argsort(got[t]["ids"])
        assert torch.equal(want[t]["ids"][order_w], got[t]["ids"][order_g])
        assert torch.equal(want[t]["rows"][order_w], got[t]["rows"][order_g])


# Two DDP ranks, sharded tables with an SSD tier: the same fit with and without the callback.
DDP_SCRIPT = r"""
import json, os, sys
import lightning.pytorch as pl
import torch
from ctr_lightning.callbacks import WorkingSetPrefetch
from ctr_lightning.datamodules import SyntheticCriteoDataModule
from ctr_lightning.embedding import StorageConfig
from ctr_lightning.models import DLRMModule

data_dir, out_dir = sys.argv[2], sys.argv[3]
out = {}
for lookahead in (0, 4):
    pl.seed_everything(0)
    dm = SyntheticCriteoDataModule(data_dir=data_dir, train_rows=12_000, val_rows=1_000, max_cardinality=5_000,
                                   batch_size=256)
    model = DLRMModule(embedding_dim=8, num_embeddings=5_000, dense_arch_layer_sizes=[16],
                       over_arch_layer_sizes=[16, 1], sparse_learning_rate=0.05, sharding="row_wise",
                       storage=StorageConfig(device_rows=300, host_rows=0, ssd_dir=os.path.join(out_dir, str(lookahead))))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[WorkingSetPrefetch(lookahead)] if lookahead else [])
    trainer.fit(model, datamodule=dm)
    model.embeddings.checkpoint_to_snapshots(None)  # whole rows, asked for
    state = model.embeddings.get_extra_state()["tables"]  # collective: every shard's rows
    stats = model.embeddings.tier_stats()
    if trainer.global_rank == 0:
        torch.save({"state": state, "dense": [p.detach().clone() for p in model.dense_parameters()]},
                   os.path.join(out_dir, f"fit{lookahead}.pt"))
    out[lookahead] = {"prefetch_hits": stats["prefetch_hits"], "ssd_hits": stats["ssd_hits"]}
print("RESULT " + json.dumps({"rank": trainer.global_rank, "stats": out}), flush=True)
import torch.distributed as _dist
if _dist.is_initialized():
    _dist.destroy_process_group()
"""


@pytest.mark.slow
def test_prefetch_callback_with_sharded_tables_under_ddp(tmp_path, run_ranks):
    SyntheticCriteoDataModule(data_dir=str(tmp_path / "data"), train_rows=12_000, val_rows=1_000,
                              max_cardinality=5_000).prepare_data()
    ranks = run_ranks(DDP_SCRIPT, [str(tmp_path / "data"), str(tmp_path)], world=2)
    for r in ranks:
        plain, ahead = r["stats"]["0"], r["stats"]["4"]
        assert plain["prefetch_hits"] == 0 and plain["ssd_hits"] > 0
        assert ahead["prefetch_hits"] > ahead["ssd_hits"], r
    plain, ahead = (torch.load(tmp_path / f"fit{k}.pt", weights_only=False) for k in (0, 4))
    for a, b in zip(plain["dense"], ahead["dense"]):
        assert torch.equal(a, b)
    for t, want in plain["state"].items():
        got = ahead["state"][t]
        order_w, order_g = torch.argsort(want["ids"]), torch.argsort(got["ids"])
        assert torch.equal(want["ids"][order_w], got["ids"][order_g])
        assert torch.equal(want["rows"][order_w], got["rows"][order_g])
