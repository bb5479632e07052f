from pathlib import Path

import pytest


def test_help_lists_the_overrides(in_process, capsys):
    with pytest.raises(SystemExit) as exit:
        in_process(["fit", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--trainer.max_steps", "--model.embedding_dim", "--model.learning_rate", "--data.batch_size",
                 "--data.train_paths", "--data.train_rows"):
        assert flag in out
    # Every model and DataModule by name, with its own arguments.
    for name in ("DLRMModule:", "DCNv2Module: --model.cross_layers", "DeepFMModule: --model.deep_layer_sizes",
                 "WideDeepModule: --model.deep_layer_sizes",
                 "CriteoDataModule:", "AvazuDataModule:", "ParquetDataModule: --data.label_column",
                 "DelimitedDataModule: --data.label_column",
                 "SyntheticCriteoDataModule:", "SyntheticStreamDataModule:", "DriftingLogDataModule: --data.data_dir, --data.days",
                 "ctr-lightning predict"):
        assert name in out, name


def test_top_level_help_lists_every_command_with_a_line(in_process, capsys):
    with pytest.raises(SystemExit) as exit:
        in_process(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    listed = out[out.index("Commands"):].splitlines()[1:8]
    assert [line.split()[0] for line in listed] == ["fit", "validate", "test", "predict", "export", "plan", "topology"]
    assert all(len(line.split()) > 3 for line in listed)  # each with what it does


@pytest.mark.parametrize("command", ["fit", "validate", "predict"])
def test_a_command_with_nothing_to_read_says_how_to_start(in_process, capsys, command):
    with pytest.raises(SystemExit) as exit:
        in_process([command])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "ctr-lightning fit --config configs/demo.yaml" in err
    assert "Traceback" not in err and "error:" not in err


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


def test_topology_prints_and_saves_this_machine(tmp_path, in_process, capsys):
    from ctr_lightning.topology import Machine

    in_process(["topology", "--save", str(tmp_path / "here.json")])
    out = capsys.readouterr().out
    assert "numa node 0:" in out and "saved to" in out
    assert Machine.load(tmp_path / "here.json").cpus


def test_plan_prints_the_placement_of_a_config(tmp_path, in_process, capsys):
    in_process(["plan", "--config", "configs/out_of_core.yaml", "--rows_per_table", "2000000",
                "--ssd_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "estimated step" in out and "t_C26" in out and str(tmp_path) in out
    # out_of_core.yaml sets its budgets itself: what fit sets up, then what storage auto would plan.
    configured, planned = [line for line in out.splitlines() if line.startswith("t_C1 ")]
    assert configured.split()[1:] == ["104,166", "0", "runs/out_of_core_ssd"]  # 80 MB of 768 B rows (Adam)
    assert "With storage: auto, fit would plan instead:" in out
    assert int(planned.split()[-3].replace(",", "")) > 0  # rows on SSD: 52M rows of 768 B do not fit in DRAM


def test_plan_reads_auto_storage_of_a_config(tmp_path, in_process, capsys):
    import yaml

    config = yaml.safe_load(open("configs/out_of_core.yaml"))
    config["model"]["storage"] = {"ssd_dirs": [str(tmp_path / "a")], "dram_fraction": 0.2}
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ["plan", "--config", str(path), "--rows_per_table", "100000",
            "--topology", "tests/topology/machines/vm_1socket.json"]
    in_process(args)
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("   0 ")).count(str(tmp_path / "a")) == 1
    assert "StorageConfig budgets by hand" not in out
    config["model"]["storage"] = {"dram_fraction": 0.01}
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit, match=r"23.0 GiB free x 0.01 over 1 rank\(s\) leaves nothing above the 2.0 GiB"):
        in_process(args)


def auto_config(tmp_path):
    path = tmp_path / "auto.yaml"
    path.write_text("model:\n  storage: auto\n")
    return path


def test_plan_for_recorded_cluster_and_refusal(tmp_path, in_process, capsys):
    in_process(["plan", "--config", "configs/multi_node.yaml", "--topology", "tests/topology/machines/dgx_a100.json"])
    out = capsys.readouterr().out
    assert "2 node(s) x 8 rank(s) (gpu)" in out and "mlx5_9" in out and "inter-node" in out
    # demo.yaml holds every row in memory: fit does not refuse it, and neither does plan; it
    # says that so many rows would not fit, and that storage auto would refuse the machine.
    in_process(["plan", "--config", "configs/demo.yaml", "--topology", "tests/topology/machines/vm_1socket.json",
                "--rows_per_table", "10000000000"])
    out = capsys.readouterr().out
    assert "so fit would be killed as the rows arrive" in out
    assert "With storage: auto, fit would refuse this machine: rank 0: its tables hold" in out
    with pytest.raises(SystemExit, match=r"auto.yaml does not fit: rank 0: its tables hold"):
        in_process(["plan", "--config", "configs/demo.yaml", "--config", str(auto_config(tmp_path)),
                    "--topology", "tests/topology/machines/vm_1socket.json", "--rows_per_table", "10000000000"])


def test_a_whole_storage_on_the_command_line_replaces_the_configs(tmp_path, in_process, capsys):
    """configs/out_of_core.yaml holds a StorageConfig; AutoStorage's keys replace it."""
    with pytest.raises(SystemExit):
        in_process(["fit", "--config", "configs/out_of_core.yaml", "--model.storage",
                    '{"ssd_dirs": ["' + str(tmp_path) + '"], "reserve_bytes": 0}', "--print_config"])
    import yaml

    storage = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["storage"]
    assert storage["ssd_dirs"] == [str(tmp_path)] and storage["reserve_bytes"] == 0 and "device_bytes" not in storage


def test_a_storage_key_set_to_null_on_the_command_line_is_none(in_process, capsys):
    """jsonargparse alone reads ``--model.storage.ssd_dir=null`` as the directory "None" and
    refuses null for an int key, inside the model's subclass spec."""
    with pytest.raises(SystemExit):
        in_process(["fit", "--config", "configs/out_of_core.yaml", "--model.storage.device_bytes=null",
                    "--model.storage.host_rows", "null", "--model.init_args.storage.ssd_dir=~",
                    "--model.storage.eviction=lfu", "--print_config"])
    import yaml

    storage = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["storage"]
    assert storage["device_bytes"] is None and storage["host_rows"] is None and storage["ssd_dir"] is None
    assert storage["eviction"] == "lfu" and storage["ssd_segment_bytes"] == 256 << 20


def test_admission_and_expiry_are_set_on_the_command_line(in_process, capsys):
    with pytest.raises(SystemExit):
        in_process(["fit", "--config", "configs/demo.yaml", "--model.admission.admit_after", "2",
                    "--model.expiry.ttl", "50000", "--model.expiry.max_rows", "1000000", "--print_config"])
    import yaml

    model = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    assert model["admission"]["admit_after"] == 2
    assert {k: model["expiry"][k] for k in ("ttl", "max_rows", "score")} == {"ttl": 50000, "max_rows": 1000000,
                                                                              "score": "lru"}


@pytest.mark.parametrize("given,halved", [([], 50000), (["--model.admission.halve_every", "0"], 0),
                                          (["--model.admission.halve_every", "720"], 720)])
def test_admission_counters_age_with_a_ttl_in_steps_given_on_the_command_line(monkeypatch, given, halved):
    # The model a config and its overrides build: an unset halve_every halves every ttl.
    from ctr_lightning.cli import build_cli

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    cli = build_cli(["--config", "configs/demo.yaml", "--model.admission.admit_after", "2",
                     "--model.expiry.ttl", "50000", *given], run=False)
    assert {s.halve_every for s in cli.model.embeddings._setup.admission.values()} == {halved}


HELP_CLASSES = [("model", m) for m in ("DLRMModule", "DCNv2Module", "DeepFMModule", "WideDeepModule")] + [
    ("data", d) for d in ("CriteoDataModule", "SyntheticCriteoDataModule", "AvazuDataModule", "ParquetDataModule",
                          "DelimitedDataModule", "SyntheticStreamDataModule", "DriftingLogDataModule")]


@pytest.mark.parametrize("group,name", HELP_CLASSES)
def test_help_of_a_class_describes_every_argument_from_its_docstring(in_process, capsys, group, name):
    import re

    with pytest.raises(SystemExit) as exit:
        in_process(["fit", f"--{group}.help", name])
    assert exit.value.code == 0
    text = capsys.readouterr().out.split("Help for", 1)[1]
    # Each option (its metavar, an alias), then its help up to "(type: ...)": the docstring's words.
    entries = re.findall(rf"^  --{group}\.(\w+)(?: (?:[A-Z_]+|\{{[^}}]*\}}))?(?:, --{group}\.\w+\+(?: [A-Z_]+)?)?(.*?)\(type:", text,
                         flags=re.MULTILINE | re.DOTALL)
    assert len(entries) > 3
    undescribed = [option for option, described in entries if not described.strip()]
    assert not undescribed, f"{name}: no description for {undescribed}"


def test_a_refused_setting_prints_its_reason_not_a_trace(tmp_path, in_process, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"click": [0, 1] * 5, "ad": list(range(10))}), tmp_path / "a.parquet")
    with pytest.raises(SystemExit) as exit:
        in_process(["fit", "--data", "ParquetDataModule", "--data.train_paths", str(tmp_path / "a.parquet"),
                    "--data.label_column", "click", "--trainer.default_root_dir", str(tmp_path)])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "ctr-lightning: error: ParquetDataModule needs the columns whose ids it embeds" in err
    assert "raised at parquet.py:" in err and "Traceback" not in err and "Union" not in err
