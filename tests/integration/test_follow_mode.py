"""Follow mode in a real Trainer: slices taken as they land, resumed exactly from a checkpoint
and after a SIGKILL (real processes through the CLI)."""

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import lightning.pytorch as pl
import pytest
import torch
import yaml

from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.models import DLRMModule


def land(root, hour, marker=True):
    part = root / "dt=2026-12-01" / f"hour={hour:02d}"
    part.mkdir(parents=True)
    write_synthetic_criteo(part / "part-0.tsv", rows=400, seed=0, stream=hour)
    if marker:
        (part / "_SUCCESS").write_text("")
    return str(part / "part-0.tsv")


class Seen(pl.Callback):
    """Each training batch's slice and a fingerprint of its examples."""

    def __init__(self, on_first_batch=None):
        self.batches, self.on_first_batch = [], on_first_batch

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        files = trainer.datamodule.epoch_files["train"]
        self.batches.append((files[0].rsplit("/", 2)[-2], round(float(batch.dense.sum()), 3), int(batch.labels.sum())))
        if self.on_first_batch is not None and len(self.batches) == 1:
            self.on_first_batch()


def model():
    return DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])


def fit(root, callbacks, ckpt_path=None, **trainer_args):
    trainer = pl.Trainer(reload_dataloaders_every_n_epochs=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, max_epochs=20, callbacks=callbacks,
                         **trainer_args)
    data = CriteoDataModule(train_paths=str(root), batch_size=100, follow=True, poll_seconds=0.05, idle_timeout=0.5)
    trainer.fit(model(), datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_a_slice_landing_during_training_is_trained_next_and_one_being_written_is_not(tmp_path):
    root = tmp_path / "logs"
    land(root, 0)
    seen = Seen(on_first_batch=lambda: (land(root, 1), land(root, 2, marker=False)))
    trainer = fit(root, [seen], enable_checkpointing=False)
    assert [b[0] for b in seen.batches] == ["hour=00"] * 4 + ["hour=01"] * 4  # hour 02 has no _SUCCESS
    assert trainer.global_step == 8 and trainer.should_stop  # ended by idle_timeout, after a whole slice


RECORDER = """
import json, os, signal
from lightning.pytorch.callbacks import Callback

class Record(Callback):
    '''Appends each training batch's step, slice and fingerprint to a JSON-lines file; with
    kill_at, SIGKILLs the process at the end of that step.'''

    def __init__(self, path: str, kill_at: int = 0):
        self.path, self.kill_at = path, kill_at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        files = trainer.datamodule.epoch_files["train"]
        with open(self.path, "a") as f:
            f.write(json.dumps([trainer.global_step, files[0].rsplit("/", 2)[-2],
                                round(float(batch.dense.sum()), 3), int(batch.labels.sum())]) + "\\n")

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
"""


def _follow_config(tmp_path, name, kill_at):
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 12, "enable_progress_bar": False,
                    "reload_dataloaders_every_n_epochs": 1, "max_epochs": 20, "num_sanity_val_steps": 0,
                    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(tmp_path / "runs"), "name": name}},
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"every_n_train_steps": 3, "save_last": True}},
                                  {"class_path": "recorder.Record",
                                   "init_args": {"path": str(tmp_path / f"{name}.jsonl"), "kill_at": kill_at}}]},
        "model": {"embedding_dim": 4, "num_embeddings": 1000, "dense_arch_layer_sizes": [4],
                  "over_arch_layer_sizes": [4, 1]},
        "data": {"class_path": "ctr_lightning.datamodules.CriteoDataModule",
                 "init_args": {"train_paths": str(tmp_path / "logs"), "batch_size": 100, "follow": True,
                               "poll_seconds": 0.05, "idle_timeout": 0.5}},
    }
    path = tmp_path / f"{name}-{kill_at}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_a_sigkill_in_the_middle_of_a_slice_resumes_at_the_next_batch(tmp_path):
    for hour in (0, 1, 2):
        land(tmp_path / "logs", hour)
    (tmp_path / "recorder.py").write_text(RECORDER)
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(tmp_path))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "ctr_lightning.cli", "fit", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(1) as pool:
        straight = pool.submit(run, "--config", _follow_config(tmp_path, "full", 0))
        killed = run("--config", _follow_config(tmp_path, "run", 7))  # step 7: the 3rd batch of hour 01
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        resumed = run("--config", _follow_config(tmp_path, "run", 0), "--ckpt_path", "last")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert straight.result().returncode == 0, straight.result().stderr[-3000:]
    full = [json.loads(line) for line in (tmp_path / "full.jsonl").read_text().splitlines()]
    run_log = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r[0] for r in full] == list(range(12)) and [r[1] for r in full] == ["hour=00"] * 4 + ["hour=01"] * 4 + [
        "hour=02"] * 4
    # Killed after step 7, last checkpoint at step 6: the resume trains the 7th batch again, then on.
    assert run_log[:7] == full[:7] and run_log[7:] == full[6:]
    a = torch.load(tmp_path / "runs" / "full" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "runs" / "run" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 12
    for key, value in a["state_dict"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b["state_dict"][key]), key
