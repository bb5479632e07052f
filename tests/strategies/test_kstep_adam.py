from ctr_lightning.strategies import KStepAdamStrategy


def test_registered_under_a_short_name():
    import lightning.pytorch as pl

    trainer = pl.Trainer(strategy="kstep_adam", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, KStepAdamStrategy) and trainer.strategy.k == 16
