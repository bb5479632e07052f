"""Resuming through ``ctr-lightning fit --ckpt_path`` as users do: from the end-of-epoch
``last.ckpt`` every shipped config writes, with overrides on the command line, with a
model class that is not the checkpoint's, and before any checkpoint exists."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ..conftest import write_avazu_layout

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ctr_lightning.cli"]


def run_cli(*args, env=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def demo(tmp_path, *extra):
    """The demo config at a small size: 3000 rows of 256, 12 steps an epoch."""
    return ["fit", "--config", "configs/demo.yaml", "--data.data_dir", str(tmp_path / "data"),
            "--data.train_rows", "3000", "--data.val_rows", "500", "--data.batch_size", "256",
            "--data.num_workers", "0", "--model.embedding_dim", "4", "--model.num_embeddings", "5000",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false",
            *extra]


def steps_of(ckpt: Path) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]


def test_demo_resumes_from_its_epoch_end_last_ckpt(tmp_path, in_process):
    # The three runs call the CLI's main() in this process (as the tests below do): the
    # command is the same, without three interpreters' start-up.
    in_process(demo(tmp_path))
    last = tmp_path / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    assert steps_of(last) == 12

    # README's resume command as it stands: max_epochs is reached already, so it ends at once.
    lightning_log = _Records()
    logging.getLogger("lightning.pytorch").addHandler(lightning_log)  # Lightning's own info lines
    try:
        in_process(demo(tmp_path, "--ckpt_path", "last"))
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(lightning_log)
    assert any("`max_epochs=1` reached" in m for m in lightning_log.messages), lightning_log.messages
    assert steps_of(last) == 12 and sorted(p.name for p in (tmp_path / "runs" / "demo").iterdir()) == ["version_0"]

    in_process(demo(tmp_path, "--ckpt_path", "last", "--trainer.max_epochs", "2"))
    assert steps_of(last) == 24  # a whole second epoch, logged on into version_0


class _Records(logging.Handler):
    """Keeps the messages of the records it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fit_shipped(main, config, train, tmp_path, *extra):
    main(["fit", "--config", config, "--data.train_paths", f"[{train}]", "--data.val_paths", f"[{train}]",
          "--data.batch_size", "256", "--data.num_workers", "0", "--model.embedding_dim", "4",
          "--model.num_embeddings", "5000", "--model.dense_arch_layer_sizes", "[8]",
          "--model.over_arch_layer_sizes", "[8, 1]", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
          "--trainer.enable_progress_bar", "false", *extra])


@pytest.mark.parametrize("config", ["criteo", "avazu"])
def test_shipped_log_configs_resume_from_their_epoch_end_last_ckpt(tmp_path, in_process, config, request):
    if config == "criteo":
        train = request.getfixturevalue("real_criteo").head  # 1,999 real rows: 8 steps
    else:
        train = request.getfixturevalue("synthetic_avazu")
    _fit_shipped(in_process, f"configs/{config}.yaml", train, tmp_path)
    (last,) = (tmp_path / "runs").glob("*/version_0/checkpoints/last.ckpt")
    one = steps_of(last)
    assert one > 0
    _fit_shipped(in_process, f"configs/{config}.yaml", train, tmp_path, "--ckpt_path", "last",
                 "--trainer.max_epochs", "2")
    assert steps_of(last) == 2 * one


@pytest.fixture
def synthetic_avazu(tmp_path):
    return write_avazu_layout(tmp_path / "avazu.csv", rows=600, seed=3)


def test_a_model_class_other_than_the_checkpoints_is_an_error_naming_both(tmp_path, in_process, capsys):
    in_process(demo(tmp_path, "--trainer.max_steps", "2"))
    ckpt = tmp_path / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    for named in (["--model", "DCNv2Module"], ["--config", "configs/dcnv2.yaml"]):
        with pytest.raises(SystemExit) as exit_:
            in_process(demo(tmp_path, *named, "--ckpt_path", str(ckpt)))
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "holds a DLRMModule" in err and "asks for DCNv2Module" in err, err
    # Naming none keeps the checkpoint's class; naming it is fine too.
    in_process(demo(tmp_path, "--model", "DLRMModule", "--ckpt_path", str(ckpt), "--trainer.max_steps", "3"))


@pytest.mark.parametrize("how", ["file", "last"])
def test_storage_given_on_the_command_line_wins_over_the_checkpoints(tmp_path, in_process, how):
    small = ["--model.storage.device_rows", "500", "--model.storage.host_rows", "0"]
    in_process(demo(tmp_path, *small, "--model.storage.ssd_dir", str(tmp_path / "ssd_old")))
    ckpt = tmp_path / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    new = tmp_path / "ssd_new"
    in_process(demo(tmp_path, *small, "--model.storage.ssd_dir", str(new), "--model.learning_rate", "0.01",
                    "--ckpt_path", str(ckpt) if how == "file" else "last", "--trainer.max_epochs", "2"))
    assert any(new.rglob("*.seg")), "the resumed run's rows went elsewhere"
    run = "version_1" if how == "file" else "version_0"  # a file starts a new run directory, as Lightning's does
    written = yaml.safe_load((tmp_path / "runs" / "demo" / run / "config.yaml").read_text())
    assert written["model"]["init_args"]["storage"]["ssd_dir"] == str(new)
    assert written["model"]["init_args"]["learning_rate"] == 0.01
    assert steps_of(tmp_path / "runs" / "demo" / run / "checkpoints" / "last.ckpt") == 24


def test_ckpt_path_last_with_no_checkpoint_starts_fresh_in_the_dead_runs_directory(tmp_path, in_process):
    fresh = run_cli(*demo(tmp_path, "--trainer.max_steps", "3"), "--ckpt_path", "last",
                    env={"CTR_LIGHTNING_KILL_AT": "train_step:2"})
    assert fresh.returncode != 0  # killed in its second step, before any checkpoint
    out = fresh.stdout + fresh.stderr
    assert f"no checkpoint found under {tmp_path / 'runs' / 'demo'}; the run starts fresh" in out
    assert "save_last" not in out
    assert [p.name for p in (tmp_path / "runs" / "demo").iterdir()] == ["version_0"]

    # The retry (nothing to kill in it) runs in this process.
    lightning_log = _Records()
    logging.getLogger("lightning.pytorch").addHandler(lightning_log)
    try:
        in_process(demo(tmp_path, "--trainer.max_steps", "3", "--ckpt_path", "last"))
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(lightning_log)
    assert any(f"--ckpt_path last: starting afresh in {tmp_path / 'runs' / 'demo' / 'version_0'}" in m
               for m in lightning_log.messages), lightning_log.messages
    assert [p.name for p in (tmp_path / "runs" / "demo").iterdir()] == ["version_0"]  # no stray version_1
    assert steps_of(tmp_path / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt") == 3


def test_a_run_saved_without_expiry_resumes_with_a_ttl_given_on_the_command_line(tmp_path, in_process):
    # An online job whose tables only grew turns expiry on at its resume: the saved rows count
    # as looked up at its last step, and those not looked up within the ttl go.
    small = ["--model.storage.device_rows", "500", "--model.storage.host_rows", "0",
             "--model.storage.ssd_dir", str(tmp_path / "ssd")]
    in_process(demo(tmp_path, *small))
    in_process(demo(tmp_path, *small, "--model.expiry.ttl", "3", "--ckpt_path", "last", "--trainer.max_epochs", "2"))
    ckpt = torch.load(tmp_path / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 24
    extra = next(v for k, v in ckpt["state_dict"].items() if k.endswith("_extra_state"))
    assert extra["expiry"] and all(floor == 24 - 3 for floor in extra["expiry"].values())
