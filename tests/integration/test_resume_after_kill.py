"""A run killed with SIGKILL resumes from its last checkpoint to the same weights, bit for
bit, with rows on SSD (streamed to table snapshots, the default for them), through ``ctr-lightning fit
--ckpt_path last``, which logs on into the killed run's TensorBoard directory. (Kills at
five points of a 2-rank run with table snapshots: test_crash_resume_ranks.py.)

Each run is a real process; the kill is a real SIGKILL from inside a training step.
"""

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, KILL_AT = 30, 5, 17  # the last checkpoint before the kill is step 15 (after 5 and 10)

KILLER = """
import os, signal
from lightning.pytorch.callbacks import Callback

class KillAtStep(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
"""

def _run(args, cwd, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(tmp_path))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _final_state(path: Path, ssd_dir: Path) -> dict:
    """Dense weights and optimizer state, and every stored table row (by id), of a checkpoint,
    loaded the way Lightning loads it (``weights_only=True``); the rows, which the default
    checkpoint of SSD tables streams to a table snapshot, through a fresh module that loads
    them (on SSD files of its own in ``ssd_dir``)."""
    from ctr_lightning.embedding import StorageConfig, TieredEmbeddingBagCollection
    from ctr_lightning.models import DLRMModule

    ckpt = torch.load(path, weights_only=True)
    assert ckpt["global_step"] == STEPS
    state = {k: v for k, v in ckpt["state_dict"].items() if not k.endswith("_extra_state")}
    assert all("snapshot" in v for k, v in ckpt["state_dict"].items() if k.endswith("_extra_state"))
    model = DLRMModule.load_from_checkpoint(path, storage=StorageConfig(device_rows=150, host_rows=0,
                                                                        ssd_dir=str(ssd_dir)))
    collection = next(m for m in model.modules() if isinstance(m, TieredEmbeddingBagCollection))
    rows = {}
    for name, table in collection._built().export().items():
        order = torch.argsort(table["ids"])  # rows are stored in tier order, not id order
        rows[name] = (table["ids"][order], table["rows"][order], table["steps"])
    assert rows
    return {"dense": state, "rows": rows, "optimizer": ckpt["optimizer_states"]}


def _assert_bit_equal(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bit_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bit_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture
def killer(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)


def _cli_config(tmp_path: Path, name: str, kill_at: int) -> Path:
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"every_n_train_steps": EVERY, "save_last": True}}]
    if kill_at:
        callbacks.append({"class_path": "killer.KillAtStep", "init_args": {"step": kill_at}})
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": STEPS, "enable_progress_bar": False,
                    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(tmp_path / "runs"), "name": name}},
                    "callbacks": callbacks},
        "model": {"embedding_dim": 8, "num_embeddings": 5000, "dense_arch_layer_sizes": [16],
                  "over_arch_layer_sizes": [16, 1],
                  "storage": {"device_rows": 150, "host_rows": 0, "ssd_dir": str(tmp_path / "ssd" / name)}},
        "data": {"class_path": "ctr_lightning.datamodules.SyntheticCriteoDataModule",
                 "init_args": {"data_dir": str(tmp_path / "data"), "train_rows": STEPS * 64 + 500, "val_rows": 500,
                               "max_cardinality": 5000, "batch_size": 64}},
    }
    path = tmp_path / f"{name}-kill{kill_at}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_cli_fit_ckpt_path_last_after_sigkill_is_bit_exact(tmp_path, killer):
    from ctr_lightning.datamodules import SyntheticCriteoDataModule

    cli = [sys.executable, "-m", "ctr_lightning.cli", "fit"]
    # The data first, so that the uninterrupted run can go on beside the killed one (their
    # own log, checkpoint and SSD directories; the same data files, read only).
    SyntheticCriteoDataModule(data_dir=str(tmp_path / "data"), train_rows=STEPS * 64 + 500, val_rows=500,
                              max_cardinality=5000, batch_size=64).prepare_data()
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(_run, [*cli, "--config", str(_cli_config(tmp_path, "full", 0))], ROOT, tmp_path)
        killed = _run([*cli, "--config", str(_cli_config(tmp_path, "run", KILL_AT))], ROOT, tmp_path)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        resumed = _run([*cli, "--config", str(_cli_config(tmp_path, "run", 0)), "--ckpt_path", "last"], ROOT,
                       tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        full = uninterrupted.result()
    assert full.returncode == 0, full.stderr[-3000:]
    # The resumed run logs on into the killed run's directory instead of a new, empty version.
    run_dir = tmp_path / "runs" / "run"
    assert sorted(p.name for p in run_dir.iterdir()) == ["version_0"]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    _assert_bit_equal(_final_state(tmp_path / "runs" / "full" / "version_0" / "checkpoints" / "last.ckpt",
                                   tmp_path / "ssd" / "read_full"),
                      _final_state(run_dir / "version_0" / "checkpoints" / "last.ckpt", tmp_path / "ssd" / "read_run"))
