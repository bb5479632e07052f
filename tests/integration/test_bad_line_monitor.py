




def test_bad_line_counts_reach_the_trainer_as_a_metric(criteo_sample, tmp_path):
    import lightning.pytorch as pl

    from ctr_lightning.callbacks import BadLineMonitor
    from ctr_lightning.datamodules import CriteoDataModule
    from ctr_lightning.models import DLRMModule

    lines = (criteo_sample.head).read_text().splitlines()
    for i in range(0, 1999, 100):
        lines[i] = lines[i].replace("\t", ",", 3)  # 20 lines with too few fields
    (tmp_path / "day_0.tsv").write_text("\n".join(lines) + "\n")
    dm = CriteoDataModule(train_paths=[str(tmp_path / "day_0.tsv")], batch_size=100, num_workers=2)
    logged = []

    class Capture(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            logged.append(float(trainer.callback_metrics["data/bad_lines"]))

    pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, log_every_n_steps=1, callbacks=[BadLineMonitor(), Capture()]).fit(
        DLRMModule(num_embeddings=100, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1]),
        datamodule=dm)
    assert dm.bad_line_counts == {str(tmp_path / "day_0.tsv"): 20}  # counted in the workers, summed here
    assert logged == [20.0]


def test_files_cut_short_under_bad_files_skip_reach_the_trainer_as_a_metric(synthetic_criteo_sample, tmp_path):
    import gzip

    import lightning.pytorch as pl

    from ctr_lightning.callbacks import BadLineMonitor
    from ctr_lightning.datamodules import CriteoDataModule
    from ctr_lightning.models import DLRMModule

    whole = gzip.compress(synthetic_criteo_sample.head.read_bytes())
    (tmp_path / "day_0.tsv.gz").write_bytes(whole[: len(whole) // 2])  # cut off mid-stream
    (tmp_path / "day_1.tsv").write_bytes(synthetic_criteo_sample.head.read_bytes())
    dm = CriteoDataModule(train_paths=[str(tmp_path / "day_0.tsv.gz"), str(tmp_path / "day_1.tsv")],
                          batch_size=100, bad_files="skip")
    logged = []

    class Capture(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            logged.append(float(trainer.callback_metrics["data/unreadable_files"]))

    pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, log_every_n_steps=1, callbacks=[BadLineMonitor(), Capture()]).fit(
        DLRMModule(num_embeddings=100, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1]),
        datamodule=dm)
    assert list(dm.unreadable_files) == [str(tmp_path / "day_0.tsv.gz")]
    assert logged == [1.0]
