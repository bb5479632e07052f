import pytest


def test_help_lists_the_overrides(in_process, capsys):
    with pytest.raises(SystemExit) as exit:
        in_process(["fit", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--trainer.max_steps", "--model.embedding_dim", "--model.learning_rate", "--data.batch_size",
                 "--data.train_paths", "--data.train_rows"):
        assert flag in out


def test_unknown_config_key_fails_naming_it(tmp_path, in_process, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  embeding_dim: 8\n")
    with pytest.raises(SystemExit) as exit:
        in_process(["fit", "--config", "configs/demo.yaml", "--config", str(config)])
    assert exit.value.code != 0
    assert "embeding_dim" in capsys.readouterr().err


def test_missing_data_path_fails_naming_it(tmp_path, in_process):
    missing = tmp_path / "no_such_day.tsv"
    with pytest.raises(FileNotFoundError, match=f"train_paths path '{missing}' matches no file"):
        in_process(["fit", "--config", "configs/demo.yaml", "--data", "ctr_lightning.datamodules.CriteoDataModule",
                    "--data.train_paths", f"[{missing}]", "--trainer.logger.init_args.save_dir",
                    str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false"])
