"""``ctr-lightning plan`` describes the tiers ``ctr-lightning fit`` sets up, for every shipped
config with the same options on the command line: both parse them alike, so the tables a
short fit ends with are the ones plan printed."""

import json
from pathlib import Path

import pytest

from tests.conftest import write_avazu_layout
from ctr_lightning.datamodules import write_synthetic_criteo

CONFIGS = sorted(p.name for p in Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))


def options(config: str, tmp_path: Path) -> list[str]:
    """What makes a short run of the config here; a storage option too, which plan must take."""
    synthetic = ["--data.data_dir", str(tmp_path / "data"), "--data.train_rows", "600", "--data.val_rows", "200",
                 "--data.batch_size", "100", "--data.num_workers", "0"]
    tsv = write_synthetic_criteo(tmp_path / "day.tsv", rows=300, seed=0)
    criteo = ["--data.train_paths", f"[{tsv}]", "--data.val_paths", f"[{tsv}]", "--data.batch_size", "100",
              "--data.num_workers", "0"]
    csv = write_avazu_layout(tmp_path / "avazu.csv", rows=300, seed=0)
    per_config = {
        "avazu.yaml": ["--data.train_paths", f"[{csv}]", "--data.val_paths", f"[{csv}]", "--data.batch_size", "100",
                       "--data.num_workers", "0", "--model.storage.device_rows", "5000"],
        "criteo.yaml": criteo + ["--model.storage.device_rows", "300000", "--model.storage.host_rows", "0",
                                 "--model.storage.ssd_dir", str(tmp_path / "ssd")],
        # Two nodes are not here: one process, its strategy merging over all (one) ranks.
        "multi_node.yaml": criteo + ["--trainer.num_nodes", "1", "--trainer.devices", "1", "--trainer.accelerator",
                                     "cpu", "--trainer.strategy.mode", "all"],
        "online.yaml": ["--data.data_dir", str(tmp_path / "log"), "--data.days", "1", "--data.hours_per_day", "1",
                        "--data.rows_per_hour", "200", "--data.batch_size", "100",
                        "--model.storage.ssd_dir", str(tmp_path / "online_ssd")],
        "out_of_core.yaml": ["--data.batch_size", "100", "--data.num_workers", "0", "--data.train_batches", "2",
                             "--trainer.callbacks.stop_at_ssd_bytes", "null",
                             "--model.storage.ssd_dir", str(tmp_path / "ooc_ssd"), "--model.storage.device_bytes",
                             "2000000"],
    }
    return per_config.get(config, synthetic + ["--model.embedding_dim", "8"])


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_plan_prints_the_tiers_fit_sets_up(tmp_path, in_process, capsys, config):
    from ctr_lightning.cli import build_cli

    args = ["--config", f"configs/{config}", *options(config, tmp_path)]
    in_process(["plan", *args, "--json", str(tmp_path / "plan.json")])
    planned = json.loads((tmp_path / "plan.json").read_text())["tiers"]
    assert "Tiers fit sets up" in capsys.readouterr().out
    cli = build_cli(["fit", *args, "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
                     "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false",
                     "--trainer.limit_val_batches", "0"])
    assert cli.trainer.global_step == 2
    fitted = json.loads(json.dumps(cli.model.embeddings.table_tiers()))
    assert planned == fitted and len(fitted) > 1
