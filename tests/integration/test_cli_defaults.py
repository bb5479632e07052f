"""What the command line does when the user leaves things out: fit without a config gets the
demo config's logger and callbacks, short runs still draw training curves, TensorBoard's
HPARAMS tab compares runs on their validation metrics, predict makes no run directory."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2


def hparams_entry(run_dir):
    """The run's HPARAMS experiment (hyper-parameter and metric names) and its session's values."""
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    content = events.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    names = {h.name for h in experiment.hparam_infos}
    metrics = {m.name.tag for m in experiment.metric_infos}
    values = {k: (v.number_value if v.HasField("number_value") else v.string_value) for k, v in start.hparams.items()}
    return names, metrics, values, events


@pytest.mark.slow
def test_fit_without_a_config_logs_like_the_demo_config_and_fills_the_hparams_tab(tmp_path, in_process):
    data = tmp_path / "data"
    in_process(["fit", "--data", "SyntheticCriteoDataModule", "--data.data_dir", str(data), "--data.train_rows", "1500",
                "--data.val_rows", "300", "--data.batch_size", "128", "--data.num_workers", "0",
                "--model.embedding_dim", "4", "--trainer.max_steps", "12", "--trainer.default_root_dir", str(tmp_path)])
    assert not (tmp_path / "lightning_logs").exists()
    run = tmp_path / "runs" / "synthetic_criteo" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file()  # the default ModelCheckpoint
    names, metrics, values, events = hparams_entry(run)
    assert {"embedding_dim", "sparse_learning_rate", "data/batch_size"} <= names
    assert values["embedding_dim"] == 4 and values["data/batch_size"] == 128
    assert {"val/auc", "val/logloss", "val/calibration"} <= metrics
    scalars = set(events.Tags()["scalars"])
    assert {"val/auc", "val/logloss", "val/calibration"} <= scalars and "hp_metric" not in scalars
    # 12 steps, fewer than Lightning's 50 between logs: a point a step, so a curve.
    assert len(events.Scalars("train/loss")) == 12
    assert "train/examples_per_sec" in scalars  # the default ExamplesPerSecond
    # --ckpt_path last finds that run under the default logger's directory and goes on in it.
    base = ["fit", "--data", "SyntheticCriteoDataModule", "--data.data_dir", str(data), "--data.train_rows", "1500",
            "--data.val_rows", "300", "--data.batch_size", "128", "--data.num_workers", "0",
            "--model.embedding_dim", "4", "--trainer.default_root_dir", str(tmp_path)]
    in_process([*base, "--trainer.max_steps", "14", "--ckpt_path", "last"])
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    import torch

    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 14
    # No checkpoints asked for: no default ModelCheckpoint to refuse them.
    in_process([*base, "--trainer.max_steps", "2", "--trainer.enable_checkpointing", "false"])


def test_predict_makes_no_run_directory(tmp_path, in_process):
    data = tmp_path / "data"
    in_process(["fit", "--config", "configs/demo.yaml", "--data.data_dir", str(data), "--data.train_rows", "600",
                "--data.val_rows", "200", "--data.batch_size", "100", "--data.num_workers", "0",
                "--model.embedding_dim", "4", "--trainer.max_steps", "3", "--trainer.enable_progress_bar", "false",
                "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    ckpt = tmp_path / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    (val,) = data.glob("*/val-*.tsv")
    in_process(["predict", "--config", "configs/demo.yaml", "--data", "CriteoDataModule",
                "--data.predict_paths", f"[{val}]", "--data.batch_size", "100",
                "--model.embedding_dim", "4", "--ckpt_path", str(ckpt), "--trainer.enable_progress_bar", "false",
                "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                "--trainer.default_root_dir", str(tmp_path / "pred")])
    assert sorted(p.name for p in (tmp_path / "runs" / "demo").iterdir()) == ["version_0"]  # no version_1
    out = tmp_path / "pred" / "predictions"
    assert (out / "scores-rank00000.tsv").is_file() and (out / "config.yaml").is_file()
    assert len((out / "scores-rank00000.tsv").read_text().splitlines()) == 201
