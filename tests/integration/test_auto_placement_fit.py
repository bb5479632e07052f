"""``storage: auto`` through a real fit: one process through the CLI, two gloo ranks."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

RANK_SCRIPT = r"""
import json, os, sys
import lightning.pytorch as pl
from ctr_lightning.datamodules import SyntheticStreamDataModule
from ctr_lightning.embedding import AutoStorage
from ctr_lightning.models import DLRMModule

ssd = sys.argv[2]
pl.seed_everything(0)
dm = SyntheticStreamDataModule(num_sparse=4, batch_size=256, train_batches=6, val_batches=0, head_size=5000,
                               num_workers=0)
model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, embedding_dim=8, num_embeddings=20_000,
                   dense_arch_layer_sizes=[16], over_arch_layer_sizes=[16, 1],
                   storage=AutoStorage(ssd_dirs=(ssd,), reserve_bytes=0), sharding="auto")
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0)
trainer.fit(model, datamodule=dm)
p = model.embeddings.placement
print("RESULT " + json.dumps({"rank": trainer.global_rank, "cpus": sorted(os.sched_getaffinity(0)),
                              "planned_cpus": list(p.rank.cpus), "world": p.plan.world_size,
                              "device_bytes": p.rank.device_bytes, "steps": trainer.global_step,
                              "dirs": model.embeddings.ssd_directories,
                              "sharding": {n: [s.kind, s.owner] for n, s in model.embeddings.sharding_plan.items()},
                              "planned": p.plan.sharding()}), flush=True)
import torch.distributed as dist
if dist.is_initialized():
    dist.destroy_process_group()
"""


def test_two_ranks_plan_share_the_machine_and_pin_their_cpus(tmp_path, run_ranks):
    import os

    ranks = run_ranks(RANK_SCRIPT, [str(tmp_path / "ssd")], world=2)
    assert [r["world"] for r in ranks] == [2, 2] and all(r["steps"] == 6 for r in ranks)
    planned = [set(r["planned_cpus"]) for r in ranks]
    assert all(set(r["cpus"]) == set(r["planned_cpus"]) for r in ranks)  # pinned to what the plan says
    if len(os.sched_getaffinity(0)) >= 2:
        assert not planned[0] & planned[1]  # two ranks on one machine: disjoint CPU sets
    # Each its half of the DRAM share, read from what was free when it planned.
    assert ranks[0]["device_bytes"] == pytest.approx(ranks[1]["device_bytes"], rel=0.02)
    assert all(r["dirs"] == [str(tmp_path / "ssd")] for r in ranks)
    # sharding "auto" under storage auto: the cost model's choice, rank 0's for both
    assert ranks[0]["sharding"] == ranks[1]["sharding"]
    assert {n: k for n, (k, _) in ranks[0]["sharding"].items()} == ranks[0]["planned"]


def test_fit_with_storage_auto_logs_the_plan(tmp_path, in_process):
    import os

    before = os.sched_getaffinity(0)  # the fit pins this process to the plan's CPUs
    try:
        in_process(["fit", "--config", "configs/out_of_core.yaml", "--trainer.max_steps", "3",
                    "--trainer.callbacks.stop_at_ssd_bytes", "null", "--model.num_embeddings", "100000",
                    "--data.batch_size", "256", "--data.num_workers", "0",
                    "--model.storage", '{"ssd_dirs": ["' + str(tmp_path / "ssd") + '"], "reserve_bytes": 0}',
                    "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                    "--trainer.enable_progress_bar", "false"])
    finally:
        os.sched_setaffinity(0, before)
    [run] = (tmp_path / "runs" / "out_of_core").iterdir()
    events = EventAccumulator(str(run), size_guidance={"tensors": 0})
    events.Reload()
    assert "placement_plan/text_summary" in events.Tags()["tensors"]
    text = events.Tensors("placement_plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "estimated step" in text and "t_C26" in text and str(tmp_path / "ssd") in text


AGREE_SCRIPT = r"""
import json, os, sys
import torch, torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from ctr_lightning.embedding import AutoStorage, SparseAdam
from ctr_lightning.topology import PlanError
from ctr_lightning.topology.auto_placement import place_tables

rank = int(sys.argv[1])
dist.init_process_group("gloo")
tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=1000, feature_names=[f"f{i}"])
          for i in range(3)]
ssd = os.path.join(sys.argv[2], f"r{rank}")
# The ranks ask for different shardings: rank 0's request holds for both.
asked = "table_wise" if rank == 0 else "row_wise"
placed = place_tables(tables, SparseAdam(), asked, AutoStorage(ssd_dirs=(ssd,), reserve_bytes=0), torch.device("cpu"),
                      dist.group.WORLD)
# Now only rank 1 cannot plan (no DRAM above its reserve): both ranks raise, neither waits.
try:
    place_tables(tables, SparseAdam(), "row_wise",
                 AutoStorage(ssd_dirs=(ssd,), reserve_bytes=0 if rank == 0 else 1 << 50), torch.device("cpu"),
                 dist.group.WORLD)
    error = None
except PlanError as err:
    error = str(err)
print("RESULT " + json.dumps({"rank": rank, "sharding": placed.plan.sharding(), "error": error}), flush=True)
dist.destroy_process_group()
"""


def test_ranks_agree_on_sharding_and_fail_together(tmp_path, run_ranks):
    ranks = run_ranks(AGREE_SCRIPT, [str(tmp_path)], world=2)
    assert [r["sharding"] for r in ranks] == [{"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"}] * 2
    assert all(r["error"] and r["error"].startswith("storage auto, rank 1 of the group: NUMA node") for r in ranks)


@pytest.mark.parametrize("snapshots", [False, True], ids=["rows_in_checkpoint", "table_snapshots"])
def test_resumed_fit_plans_with_its_data_then_restores_the_rows(tmp_path, snapshots):
    import os

    import lightning.pytorch as pl
    import torch

    from ctr_lightning.callbacks import TableSnapshots
    from ctr_lightning.datamodules import SyntheticStreamDataModule
    from ctr_lightning.embedding import AutoStorage
    from ctr_lightning.models import DLRMModule

    def run(max_steps, ckpt_path=None):
        pl.seed_everything(0)
        dm = SyntheticStreamDataModule(num_sparse=2, batch_size=128, train_batches=8, val_batches=0, head_size=500,
                                       num_workers=0)
        model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, embedding_dim=8, num_embeddings=2000,
                           dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1],
                           storage=AutoStorage(ssd_dirs=(str(tmp_path / "ssd"),), reserve_bytes=0))
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                             default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, limit_val_batches=0,
                             callbacks=[TableSnapshots()] if snapshots else None)
        if not snapshots:
            model.embeddings.checkpoint_to_snapshots(None)  # every row in the .ckpt, asked for
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return model, trainer

    before = os.sched_getaffinity(0)  # fit pins this process to the plan's CPUs
    try:
        trained, trainer = run(3)
        [ckpt] = (tmp_path / "checkpoints").glob("*.ckpt")
        resumed, again = run(3, str(ckpt))  # nothing left to train: the rows are the checkpoint's
    finally:
        os.sched_setaffinity(0, before)
    assert again.global_step == 3
    # Planned in on_fit_start with the data's batch, after the load was read
    assert resumed.embeddings.placement.plan.examples_per_step == 128
    ids = torch.arange(500)
    for table in (f"t_{name}" for name in resumed.sparse_feature_names):
        assert torch.equal(resumed.embeddings.rows(table, ids), trained.embeddings.rows(table, ids))
    if snapshots:  # the resumed rows are the snapshot's: a checkpoint now refers to it, writes nothing new
        assert resumed.embeddings.get_extra_state()["snapshot"] == str(resumed.embeddings.current_snapshot())
        assert resumed.embeddings.snapshots_written == []


def test_storage_monitor_checks_the_disk_of_the_planned_ssd_directory_after_planning(tmp_path):
    import os

    import lightning.pytorch as pl

    from ctr_lightning.callbacks import StorageMonitor
    from ctr_lightning.datamodules import SyntheticStreamDataModule
    from ctr_lightning.embedding import AutoStorage
    from ctr_lightning.models import DLRMModule

    dm = SyntheticStreamDataModule(num_sparse=2, batch_size=128, train_batches=4, val_batches=0, head_size=500,
                                   num_workers=0)
    model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, embedding_dim=8, num_embeddings=2000,
                       dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1],
                       storage=AutoStorage(ssd_dirs=(str(tmp_path / "ssd"),), reserve_bytes=0))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[StorageMonitor(stop_at_ssd_bytes="1000TB")])
    before = os.sched_getaffinity(0)
    try:
        with pytest.raises(ValueError, match=rf"SSD directory {tmp_path / 'ssd'} has .* GiB free"):
            trainer.fit(model, datamodule=dm)
    finally:
        os.sched_setaffinity(0, before)
    assert model.embeddings.placement.plan.examples_per_step == 128  # planned at fit start, with the data
    assert trainer.global_step == 0
