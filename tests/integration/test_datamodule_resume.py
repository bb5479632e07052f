import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.models import DLRMModule


class SeenExamples(pl.Callback):
    """Records every training example (as its ids) in the order the model sees them."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, ...]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        n = len(batch)
        ids = batch.sparse.values().reshape(26, n).T
        self.seen += [tuple(row) for row in ids.tolist()]


def model():
    return DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])


def trainer(tmp_path, callbacks, **kwargs):
    return pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, callbacks=callbacks, **kwargs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_run_sees_exactly_the_remaining_examples(tmp_path, num_workers):
    # Three files of unequal size; 3 small messages per worker so several are in flight.
    for day, rows in enumerate([1500, 900, 1300]):
        write_synthetic_criteo(tmp_path / f"day_{day}.tsv", rows=rows, seed=0, stream=day)
    def datamodule():
        dm = CriteoDataModule(train_paths=str(tmp_path / "day_*.tsv"), batch_size=100, num_workers=num_workers)
        return dm

    first = SeenExamples()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=13, save_top_k=-1)
    # The first run "dies" after 13 steps: its checkpoint is all that is left of it.
    trainer(tmp_path, [first, ckpt], max_steps=13).fit(model(), datamodule=datamodule())
    path = next((tmp_path / "ckpt").glob("*step=13*.ckpt"))
    assert len(first.seen) == 13 * 100

    # The resumed run dies too, at its own checkpoint, which must count the batches of
    # both runs; a third run resumes from it.
    second = SeenExamples()
    trainer(tmp_path, [second, ckpt], max_steps=26).fit(model(), datamodule=datamodule(), ckpt_path=str(path))
    path = next((tmp_path / "ckpt").glob("*step=26*.ckpt"))
    third = SeenExamples()
    trainer(tmp_path, [third], max_epochs=1).fit(model(), datamodule=datamodule(), ckpt_path=str(path))

    everything = SeenExamples()
    trainer(tmp_path, [everything], max_epochs=1).fit(model(), datamodule=datamodule())
    assert len(everything.seen) == 3700
    assert len(second.seen) == 13 * 100
    assert len(first.seen) + len(second.seen) + len(third.seen) == 3700  # none lost, none repeated
    assert sorted(first.seen + second.seen + third.seen) == sorted(everything.seen)
    assert not set(first.seen) & set(second.seen) and not set(second.seen) & set(third.seen)


class SeenPerEpoch(pl.Callback):
    """Counts the training examples each epoch sees."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.counts[trainer.current_epoch] = self.counts.get(trainer.current_epoch, 0) + len(batch)


def test_the_epoch_after_a_mid_epoch_resume_reads_everything(tmp_path):
    # Lightning reuses the train loader: the resume's skips belong to its own epoch only.
    write_synthetic_criteo(tmp_path / "day_0.tsv", rows=1500, seed=0)
    datamodule = lambda: CriteoDataModule(train_paths=str(tmp_path / "day_0.tsv"), batch_size=100)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    trainer(tmp_path, [ckpt], max_steps=6).fit(model(), datamodule=datamodule())
    seen = SeenPerEpoch()
    trainer(tmp_path, [seen], max_epochs=2).fit(model(), datamodule=datamodule(),
                                                ckpt_path=str(next((tmp_path / "ckpt").glob("*step=6*.ckpt"))))
    assert seen.counts == {0: 900, 1: 1500}


def test_mid_epoch_resume_with_another_layout_is_a_clear_error(tmp_path):
    write_synthetic_criteo(tmp_path / "day_0.tsv", rows=1000, seed=0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3)
    trainer(tmp_path, [ckpt], max_steps=3).fit(
        model(), datamodule=CriteoDataModule(train_paths=str(tmp_path / "day_0.tsv"), batch_size=100))
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    with pytest.raises(ValueError, match="cannot resume mid-epoch"):
        trainer(tmp_path, [], max_epochs=1).fit(
            model(), datamodule=CriteoDataModule(train_paths=str(tmp_path / "day_0.tsv"), batch_size=50),
            ckpt_path=str(path))


ROTATION_SCRIPT = r"""
import json, os, sys
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from ctr_lightning.datamodules import CriteoDataModule
from ctr_lightning.models import DLRMModule

rank, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]

class Seen(pl.Callback):
    def __init__(self):
        self.seen = {}
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        rows = batch.sparse.values().reshape(26, len(batch)).T  # a row's 26 ids tell it apart
        self.seen.setdefault(trainer.current_epoch, []).extend(",".join(map(str, r)) for r in rows.tolist())

# The first run, then the resumed one, in turn in these processes: the resumed run a fresh
# data module, model and Trainer with only the first one's checkpoint to go on.
def fit(resume):
    dm = CriteoDataModule(train_paths=[path], batch_size=50, shuffle_shards=True, shuffle_seed=7)
    model = DLRMModule(num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    seen = Seen()
    callbacks = [seen, ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{step}", every_n_train_steps=17,
                                       save_top_k=-1)]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, max_steps=-1 if resume else 17,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, datamodule=dm, ckpt_path=os.path.join(out, "ckpt", "step=17.ckpt") if resume else None)
    return seen.seen

print("RESULT " + json.dumps({"rank": rank, "first": fit(False), "resumed": fit(True)}), flush=True)
import torch.distributed as _dist
if _dist.is_initialized():
    _dist.destroy_process_group()
"""


@pytest.mark.slow
def test_rotating_shards_resume_exactly_on_two_ranks(tmp_path, run_ranks):
    # 1,200 rows, 600 a rank, 12 steps an epoch: the first run stops 5 steps into epoch 1.
    path = write_synthetic_criteo(tmp_path / "day_0.tsv", rows=1200, seed=0)
    ranks = sorted(run_ranks(ROTATION_SCRIPT, [str(path), str(tmp_path)], world=2), key=lambda r: r["rank"])
    everything = []
    for a, b in ((r["first"], r["resumed"]) for r in ranks):
        epoch0, epoch1_before, epoch1_after = a["0"], a["1"], b["1"]
        assert len(epoch0) == 600 and len(epoch1_before) == 5 * 50 and len(epoch1_after) == 600 - 5 * 50
        assert not set(epoch1_before) & set(epoch1_after)  # none repeated, none lost
        everything.append((set(epoch0), set(epoch1_before) | set(epoch1_after)))
    for epoch in (0, 1):  # the ranks split each epoch's rows between them
        assert len(everything[0][epoch] | everything[1][epoch]) == 1200
    assert everything[0][0] != everything[0][1]  # rank 0 read other pieces in epoch 1


@pytest.mark.parametrize("save_on_train_epoch_end", [True, False])
def test_an_epoch_end_checkpoint_resumes_into_the_next_epoch(tmp_path, save_on_train_epoch_end):
    # Saved at the end of the epoch (on_train_epoch_end), or by validation after its last
    # batch: either way epoch 1 reads every row, in epoch 1's pieces, as an unbroken run does.
    write_synthetic_criteo(tmp_path / "day_0.tsv", rows=1500, seed=0)
    write_synthetic_criteo(tmp_path / "val.tsv", rows=200, seed=1)
    datamodule = lambda: CriteoDataModule(train_paths=str(tmp_path / "day_0.tsv"), val_paths=str(tmp_path / "val.tsv"),
                                          batch_size=100, shuffle_shards=True, shuffle_seed=3)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_on_train_epoch_end=save_on_train_epoch_end)
    first = SeenPerEpoch()
    trainer(tmp_path, [first, ckpt], max_epochs=1).fit(model(), datamodule=datamodule())
    assert first.counts == {0: 1500}

    # max_epochs reached already: Lightning ends at once, with no error and no step.
    again = SeenPerEpoch()
    done = trainer(tmp_path, [again], max_epochs=1)
    done.fit(model(), datamodule=datamodule(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert again.counts == {} and done.global_step == 15

    resumed, unbroken = SeenExamples(), SeenExamples()
    t = trainer(tmp_path, [resumed], max_epochs=2)
    t.fit(model(), datamodule=datamodule(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert t.global_step == 30 and t.current_epoch == 2
    everything = SeenExamples()
    class EpochOne(SeenExamples):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if trainer.current_epoch == 1:
                super().on_train_batch_start(trainer, module, batch, batch_idx)
    unbroken = EpochOne()
    trainer(tmp_path, [unbroken], max_epochs=2).fit(model(), datamodule=datamodule())
    assert len(resumed.seen) == 1500 and resumed.seen == unbroken.seen  # same rows, same order


def test_an_epoch_end_checkpoint_of_an_online_run_trains_the_next_slice(tmp_path):
    for day in range(3):
        write_synthetic_criteo(tmp_path / f"2026-01-0{day + 1}.tsv", rows=300 + 100 * day, seed=0, stream=day)
    datamodule = lambda: CriteoDataModule(train_paths=str(tmp_path / "2026-*.tsv"), batch_size=100, online=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer(tmp_path, [ckpt], max_epochs=1, reload_dataloaders_every_n_epochs=1).fit(model(), datamodule=datamodule())
    seen = SeenPerEpoch()
    trainer(tmp_path, [seen], max_epochs=2, reload_dataloaders_every_n_epochs=1).fit(
        model(), datamodule=datamodule(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert seen.counts == {1: 400}  # the second slice, trained on once
