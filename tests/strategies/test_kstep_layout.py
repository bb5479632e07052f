from ctr_lightning.strategies import KStepAdamStrategy
from ctr_lightning.strategies.kstep_layout import kstep_layout


def test_ranks_per_node_from_the_argument_the_launcher_or_the_devices(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert kstep_layout(2, world_size=8, rank=5, devices_per_node=4).local_world_size == 2
    assert kstep_layout(None, world_size=8, rank=5, devices_per_node=4).local_world_size == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert kstep_layout(None, world_size=8, rank=5, devices_per_node=4).local_world_size == 8


def test_nvlink_layout_on_a_machine_without_gpus_is_the_node(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    strategy = KStepAdamStrategy(k=2, local_world_size="nvlink", merge_optimizer_state=False)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    assert strategy.layout.local_world_size == 1 and trainer.global_step == 2
