import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ctr_lightning.cli"]


def run_cli(*args, cwd=ROOT):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def test_tiny_fit_logs_to_tensorboard_and_checkpoints(tmp_path):
    result = run_cli(
        "fit", "--config", "configs/demo.yaml",
        "--data.data_dir", str(tmp_path / "data"), "--data.train_rows", "4000", "--data.val_rows", "1000",
        "--data.batch_size", "128", "--model.embedding_dim", "8", "--model.num_embeddings", "5000",
        "--trainer.max_epochs", "2", "--trainer.max_steps", "40", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        "--trainer.enable_progress_bar", "false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log_dir = tmp_path / "runs" / "demo" / "version_0"
    out = result.stdout + result.stderr
    assert f"tensorboard --logdir {tmp_path / 'runs'}" in out
    assert str(log_dir / "checkpoints" / "last.ckpt") in out
    assert (log_dir / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "data" / "seed0-card100000-zipf1.1" / "train-4000.tsv").is_file()

    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/examples_per_sec", "val/loss", "val/auc", "val/logloss", "val/ne",
                "val/calibration"):
        assert tag in tags, sorted(tags)
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    assert hparams["embedding_dim"] == 8 and hparams["train_rows"] == 4000 and hparams["batch_size"] == 128
    # One whole epoch (32 steps, then validation), then max_steps stops epoch two early.
    assert events.Scalars("val/auc")[0].step == 31
    assert events.Scalars("train/loss")[-1].step < 40


def _fit_shipped_config(main, config, train, val, tmp_path) -> set[str]:
    """Trains with a shipped config, in this process; returns the scalars it logged."""
    main(["fit", "--config", config, "--data.train_paths", f"[{train}]", "--data.val_paths", f"[{val}]",
          "--data.batch_size", "256", "--data.num_workers", "0", "--model.embedding_dim", "8",
          "--model.dense_arch_layer_sizes", "[8]", "--model.over_arch_layer_sizes", "[16, 1]",
          "--trainer.max_epochs", "1", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
          "--trainer.enable_progress_bar", "false"])
    (run,) = (tmp_path / "runs").glob("*/version_0")
    assert (run / "checkpoints" / "last.ckpt").is_file()
    events = EventAccumulator(str(run))
    events.Reload()
    return set(events.Tags()["scalars"])


def _mann_whitney_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """P(score of a click > score of a non-click), ties counting 1/2, over every pair."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
                 / (len(pos) * len(neg)))


def _check_logged_auc(main, config, val, tmp_path) -> None:
    """The run's last val/auc is the AUC of its last checkpoint's scores on the validation
    file, computed here from ``predict``'s output over every pair of records."""
    (run,) = (tmp_path / "runs").glob("*/version_0")
    events = EventAccumulator(str(run))
    events.Reload()
    logged = events.Scalars("val/auc")[-1].value
    main(["predict", "--config", config, "--data.predict_paths", f"[{val}]", "--data.batch_size", "256",
          "--data.num_workers", "0", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"),
          "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / "pred")])
    table = np.loadtxt(tmp_path / "pred" / "predictions" / "scores-rank00000.tsv", skiprows=1, ndmin=2)
    assert 0.0 < logged <= 1.0
    assert abs(_mann_whitney_auc(table[:, 1], table[:, 2]) - logged) < 1e-4, logged


def test_shipped_avazu_config_trains(tmp_path, avazu_sample, in_process):
    assert "val/auc" in _fit_shipped_config(in_process, "configs/avazu.yaml", avazu_sample, avazu_sample, tmp_path)
    _check_logged_auc(in_process, "configs/avazu.yaml", avazu_sample, tmp_path)


def test_shipped_criteo_config_trains(tmp_path, criteo_sample, in_process):
    scalars = _fit_shipped_config(in_process, "configs/criteo.yaml", criteo_sample.head, criteo_sample.head, tmp_path)
    assert "val/auc" in scalars  # (8 steps: fewer than log_every_n_steps, so no train/loss)
    _check_logged_auc(in_process, "configs/criteo.yaml", criteo_sample.head, tmp_path)


@pytest.mark.slow
def test_multi_node_config_trains_with_kstep_adam_on_two_processes(tmp_path, synthetic_criteo_sample):
    data = synthetic_criteo_sample
    # One machine, two CPU processes as one node each: Lightning starts the second itself.
    result = run_cli(
        "fit", "--config", "configs/multi_node.yaml", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
        "--trainer.num_nodes", "1", "--trainer.strategy.init_args.mode", "all",
        "--trainer.strategy.init_args.k", "4", "--trainer.strategy.init_args.warmup_steps", "2",
        "--data.train_paths", f"[{data.big}]", "--data.val_paths", f"[{data.head}]",
        "--data.batch_size", "256", "--data.num_workers", "0", "--model.embedding_dim", "8",
        "--model.dense_arch_layer_sizes", "[8]", "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false",
        "--trainer.log_every_n_steps", "1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "KStepAdamStrategy: k=4, mode=all, 1 node(s) x 2 rank(s)" in out and "val/auc=" in out
    events = EventAccumulator(str(next((tmp_path / "runs").rglob("events.out.tfevents.*")))).Reload()
    assert {"kstep/merge_ms", "kstep/divergence", "kstep/intra_node_bytes"} <= set(events.Tags()["scalars"])


@pytest.mark.parametrize("config", ["dcnv2", "deepfm", "wide_deep"])
def test_each_model_config_trains_and_its_checkpoint_predicts(tmp_path, in_process, config):
    data = tmp_path / "data"
    in_process(["fit", "--config", f"configs/{config}.yaml", "--data.data_dir", str(data),
                "--data.train_rows", "3000", "--data.val_rows", "500", "--data.batch_size", "256",
                "--data.num_workers", "0", "--model.embedding_dim", "4", "--model.deep_layer_sizes", "[8]",
                "--trainer.max_steps", "12", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    run = tmp_path / "runs" / config / "version_0"
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["deep_layer_sizes"] == [8] and hparams["embedding_dim"] == 4
    events = EventAccumulator(str(run))
    events.Reload()
    assert {"val/auc", "val/logloss", "val/calibration"} <= set(events.Tags()["scalars"])
    # predict with the fitted checkpoint: scores stream to files, one line per record.
    (val,) = data.glob("*/val-*.tsv")
    in_process(["predict", "--config", f"configs/{config}.yaml", "--data", "CriteoDataModule",
                "--data.predict_paths", f"[{val}]", "--data.batch_size", "128", "--model.embedding_dim", "4",
                "--model.deep_layer_sizes", "[8]", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"),
                "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / "pred")])
    lines = (tmp_path / "pred" / "predictions" / "scores-rank00000.tsv").read_text().splitlines()
    assert lines[0] == "row\tlabel\tscore" and len(lines) == 501
    assert [int(line.split("\t")[0]) for line in lines[1:]] == list(range(500))
    # The scores are the checkpoint's model's own, record by record (a wrong checkpoint, a
    # model left untrained or rows out of order would not be).
    import torch

    from ctr_lightning.datamodules import CriteoDataModule
    from ctr_lightning.models import MODELS

    model_class = next(m for m in MODELS if m.__name__ == {"dcnv2": "DCNv2Module", "deepfm": "DeepFMModule",
                                                           "wide_deep": "WideDeepModule"}[config])
    model = model_class.load_from_checkpoint(run / "checkpoints" / "last.ckpt").eval()
    dm = CriteoDataModule(predict_paths=[str(val)], batch_size=128, num_workers=0)
    dm.setup("predict")
    with torch.no_grad():
        batches = list(dm.predict_dataloader())
        want = torch.cat([torch.sigmoid(model(b)) for b in batches]).numpy()
    labels = torch.cat([b.labels for b in batches]).numpy()
    got = [line.split("\t") for line in lines[1:]]
    assert [float(g[1]) for g in got] == labels.tolist()
    np.testing.assert_allclose([float(g[2]) for g in got], want, rtol=1e-6, atol=0)
    untrained = torch.sigmoid(model_class(**{k: v for k, v in model.hparams.items() if not k.startswith("_")})(
        batches[0])).detach().numpy()
    assert np.abs(untrained - want[:128]).max() > 1e-3  # the check can tell a trained model from a fresh one


def test_shipped_online_config_follows_a_drifting_log_and_exports_for_serving(tmp_path, in_process):
    """configs/online.yaml, two shorter days: every hour trained in time order and scored
    first, rows expired, and a full export then a delta that read back as the model's rows."""
    from ctr_lightning.serving import read_export

    in_process(["fit", "--config", "configs/online.yaml", "--data.days", "2", "--data.rows_per_hour", "256",
                "--data.batch_size", "256", "--data.data_dir", str(tmp_path / "log"),
                "--model.storage.ssd_dir", str(tmp_path / "ssd"), "--model.expiry.ttl", "6h",
                "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false"])
    (run,) = (tmp_path / "runs").glob("online/version_0")
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"online/auc", "storage/rows_expired", "storage/rows_rejected", "storage/live_rows/t_C1"} <= tags
    assert len(events.Scalars("online/logloss")) == 48  # an hour a slice, each scored before it trained
    assert events.Scalars("storage/rows_expired")[-1].value > 0
    exports = run / "serving"
    assert (exports / "LATEST").read_text().strip() == "step=000000048"
    served = read_export(exports / "step=000000048")
    assert [p.name for p in served.chain] == ["step=000000024", "step=000000048"]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 48 and dict(ckpt["hyper_parameters"]["expiry"])["ttl"] == "6h"
    assert sum(len(t) for t in served.tables.values()) > 1000
