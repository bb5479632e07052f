"""A training run of 2 gloo ranks, with rows on SSD and table snapshots every few steps, is
killed with SIGKILL at 5 points chosen at random each test run (one per kill point of
:mod:`ctr_lightning.fault_points`: mid-step, in an eviction's SSD write, in an SSD
cleaning, while a snapshot's row files are written, between the row files and the
manifest). After each kill ``ctr-lightning fit --ckpt_path last`` resumes on both ranks;
the run that finally completes ends bit for bit where an uninterrupted one does."""

import os
import random
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ctr_lightning.embedding.snapshots.table_snapshot import MANIFEST, WRITING, SnapshotManifest, read_snapshot_file
from ctr_lightning.fault_points import POINTS

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, BATCH = 48, 4, 32
# Kill at the n-th arrival, n drawn from 1..MOST: every resumed run gets that far early.
MOST = {"train_step": 6, "ssd_write": 20, "ssd_clean": 3, "snapshot_rows": 4, "snapshot_manifest": 2}


def _config(tmp_path: Path, work: Path) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": STEPS, "logger": False,
                    "default_root_dir": str(work),
                    "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                    "limit_val_batches": 0,
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(work / "ckpt"), "every_n_train_steps": EVERY,
                                                 "save_last": True}},
                                  {"class_path": "ctr_lightning.callbacks.TableSnapshots"}]},
        "model": {"embedding_dim": 8, "num_embeddings": 5000, "dense_arch_layer_sizes": [16],
                  "over_arch_layer_sizes": [16, 1],
                  # A tiny device tier and tiny SSD segments: evictions and cleanings every step.
                  "storage": {"device_rows": 40, "host_rows": 0, "ssd_dir": str(work / "ssd"),
                              "ssd_segment_bytes": 4096}},
        "data": {"class_path": "ctr_lightning.datamodules.SyntheticCriteoDataModule",
                 "init_args": {"data_dir": str(tmp_path / "data"), "train_rows": STEPS * 2 * BATCH + 100,
                               "val_rows": 200, "max_cardinality": 5000, "batch_size": BATCH}},
    }
    path = work / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def _final(work: Path) -> dict:
    """The dense weights and optimizer state of the final checkpoint, and every table row
    (with its Adam state) of the snapshot it names (through its chain of incremental
    snapshots, newest copy first), by table and id."""
    ckpt = torch.load(work / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == STEPS
    state = dict(ckpt["state_dict"])
    snapshots = {state.pop(k)["snapshot"] for k in [k for k in state if k.endswith("_extra_state")]}
    assert len(snapshots) == 1
    snapshot = Path(snapshots.pop())
    manifest = SnapshotManifest.read(snapshot)
    assert manifest.world_size == 2
    rows = {}
    for path, member in manifest.chain(snapshot):
        for f in member.files:
            for names, tables, ids, values in read_snapshot_file(path, f):
                for t, i, row in zip(tables.tolist(), ids.tolist(), values):
                    rows.setdefault((names[t], i), row)
    return {"dense": state, "optimizer": ckpt["optimizer_states"], "rows": rows, "steps": manifest.steps}


@pytest.mark.slow
def test_sigkill_at_five_random_points_then_fit_ckpt_path_last_is_bit_exact(tmp_path, until_one_exits):
    from ctr_lightning.datamodules import SyntheticCriteoDataModule

    seed = int(os.environ.get("CRASH_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
    rng = random.Random(seed)
    kills = []
    for point in rng.sample(POINTS, len(POINTS)):
        rank = 0 if point == "snapshot_manifest" else rng.randrange(2)  # rank 0 writes the manifest
        kills.append((point, rng.randint(1, MOST[point]), rank))
    where = f"CRASH_TEST_SEED={seed}, kills {kills}"
    SyntheticCriteoDataModule(data_dir=str(tmp_path / "data"), train_rows=STEPS * 2 * BATCH + 100, val_rows=200,
                              max_cardinality=5000, batch_size=BATCH).prepare_data()
    fit = [sys.executable, "-m", "ctr_lightning.cli", "fit", "--config"]

    full = until_one_exits([*fit, str(_config(tmp_path, tmp_path / "full"))], 2, [{}, {}])
    assert [code for code, _ in full] == [0, 0], f"{where}\n{full}"

    work = tmp_path / "crashed"
    config = str(_config(tmp_path, work))
    for n, (point, count, rank) in enumerate(kills):
        env = [{}, {}]
        env[rank] = {"CTR_LIGHTNING_KILL_AT": f"{point}:{count}"}
        resume = ["--ckpt_path", "last"] if (work / "ckpt" / "last.ckpt").exists() else []
        ranks = until_one_exits([*fit, config, *resume], 2, env)
        assert ranks[rank][0] == -signal.SIGKILL, f"{where}: kill {n} ({point}) did not happen\n{ranks}"
    resumed = until_one_exits([*fit, config, "--ckpt_path", "last"], 2, [{}, {}])
    assert [code for code, _ in resumed] == [0, 0], f"{where}\n{resumed}"
    # Kills in a save left snapshots without a manifest; resumed runs deleted them, and
    # completed saves leave no lock file.
    assert all((d / MANIFEST).exists() and not list(d.glob(f"{WRITING}*"))
               for d in (work / "ckpt" / "table_snapshots").iterdir()), where

    a, b = _final(tmp_path / "full"), _final(work)
    assert a["steps"] == b["steps"], where
    assert a["rows"].keys() == b["rows"].keys(), where
    assert all(torch.equal(a["rows"][k], b["rows"][k]) for k in a["rows"]), where
    assert a["dense"].keys() == b["dense"].keys()
    for k in a["dense"]:
        assert torch.equal(a["dense"][k], b["dense"][k]), f"{where}: {k}"
    torch.testing.assert_close(a["optimizer"], b["optimizer"], rtol=0, atol=0, msg=where)
