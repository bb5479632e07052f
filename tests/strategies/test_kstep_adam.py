
import pytest

from ctr_lightning.strategies import KStepAdamStrategy, NodeLayout


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        KStepAdamStrategy(k=0)
    with pytest.raises(ValueError, match="mode must be 'all' or 'node'"):
        KStepAdamStrategy(mode="ring")
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        KStepAdamStrategy(warmup_steps=-1)
    with pytest.raises(ValueError, match="moment_dtype must be one of .*float16 would flush"):
        KStepAdamStrategy(moment_dtype="float16")
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        NodeLayout.of(world_size=6, rank=0, local_world_size=4)
    layout = NodeLayout.of(world_size=4, rank=3, local_world_size=2)
    assert (layout.node, layout.local_rank, layout.num_nodes) == (1, 1, 2)


def test_registered_under_a_short_name():
    import lightning.pytorch as pl

    trainer = pl.Trainer(strategy="kstep_adam", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, KStepAdamStrategy) and trainer.strategy.k == 16
