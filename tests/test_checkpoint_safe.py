"""Every config class the project exports loads from a checkpoint with ``weights_only=True``
in a fresh process that imported only torch and ctr_lightning."""

import dataclasses
import importlib
import os
import subprocess
import sys
import zipfile

import lightning.pytorch as pl
import pytest
import torch

import ctr_lightning
from ctr_lightning.checkpoint_safe import checkpoint_safe

PUBLIC_MODULES = ["ctr_lightning", "ctr_lightning.embedding", "ctr_lightning.datamodules",
                  "ctr_lightning.strategies", "ctr_lightning.models", "ctr_lightning.callbacks"]


def exported_configs() -> list[type]:
    found = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", dir(module)):
            value = getattr(module, attr)
            if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
                found[value.__qualname__] = value
    return [found[k] for k in sorted(found)]


# Instances with values other than the defaults, so the reload is seen to keep them.
EXAMPLES = {
    "StorageConfig": dict(device_rows=10, host_bytes=1 << 20, ssd_dir="/tmp/x", eviction="lfu"),
    "AutoStorage": dict(ssd_dirs=("/tmp/a", "/tmp/b"), dram_fraction=0.25, profile_batches=3),
    "SparseSGD": dict(lr=0.5),
    "SparseAdagrad": dict(lr=0.2, eps=1e-6),
    "RowWiseAdagrad": dict(lr=0.3),
    "SparseAdam": dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7),
    "TableSharding": dict(kind="table_wise", owner=1),
    "SyntheticCriteoSpec": dict(seed=3, max_cardinality=77),
    "NodeLayout": dict(world_size=4, rank=3, local_world_size=2),
    "Admission": dict(admit_after=3, sketch_bytes=1 << 21, seed=5),
    "Expiry": dict(ttl=1000, max_rows=10**6),
}


class HoldsConfigs(pl.LightningModule):
    def __init__(self, configs: dict, listed: list) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(2, 1)


def test_every_exported_config_has_an_example():
    names = {c.__name__ for c in exported_configs()}
    assert {"StorageConfig", "SparseAdam", "TableSharding"} <= names
    assert names == set(EXAMPLES), "add an example for each new config class"


def test_exported_configs_load_with_weights_only_in_a_fresh_process(tmp_path):
    configs = {c.__name__: c(**EXAMPLES[c.__name__]) for c in exported_configs()}
    module = HoldsConfigs(configs, list(configs.values()))
    trainer = pl.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.strategy.connect(module)
    path = tmp_path / "configs.ckpt"
    trainer.save_checkpoint(path)
    script = ("import sys, torch, ctr_lightning\n"
              "h = torch.load(sys.argv[1], weights_only=True)['hyper_parameters']\n"
              "print('RESULT', repr(h['configs']), repr(h['listed']))")
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))
    assert line == f"RESULT {configs!r} {list(configs.values())!r}"


def test_checkpoints_naming_a_moved_class_by_its_old_path_still_load(tmp_path, monkeypatch):
    from ctr_lightning.node_layout import NodeLayout
    from ctr_lightning.synthetic_criteo_spec import SyntheticCriteoSpec

    old = {NodeLayout: "ctr_lightning.strategies.node_layout",
           SyntheticCriteoSpec: "ctr_lightning.datamodules.synthetic_criteo"}
    for cls, module in old.items():
        monkeypatch.setattr(cls, "__module__", module)  # as checkpoints written before the move name it
    configs = [NodeLayout(4, 3, 2), SyntheticCriteoSpec(seed=3)]
    path = tmp_path / "old.ckpt"
    torch.save({"configs": configs}, path)
    monkeypatch.undo()
    with zipfile.ZipFile(path) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert all(module.encode() in pickled for module in old.values())
    script = ("import sys, torch, ctr_lightning\n"
              "print('RESULT', repr(torch.load(sys.argv[1], weights_only=True)['configs']))")
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"RESULT {configs!r}" in result.stdout.splitlines()
    assert torch.load(path, weights_only=False)["configs"] == configs  # the old modules still import them


def test_only_frozen_dataclasses_are_allowed():
    class Mutable:
        pass

    with pytest.raises(TypeError, match="frozen dataclass"):
        checkpoint_safe(Mutable)
    assert ctr_lightning.__version__
