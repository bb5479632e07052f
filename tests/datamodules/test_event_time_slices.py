import gzip

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from ctr_lightning.callbacks import ProgressiveValidation
from ctr_lightning.datamodules import CriteoDataModule, DelimitedDataModule, DelimitedFormat, write_synthetic_criteo
from ctr_lightning.datamodules import event_time_slices
from ctr_lightning.datamodules.bad_lines import UnreadableFileError
from ctr_lightning.datamodules.batch_loader import BatchDataLoader
from ctr_lightning.datamodules.event_time_slices import cut_event_time_slices
from ctr_lightning.datamodules.stream_dataset import LogStreamDataset, index_log_files
from ctr_lightning.models import DLRMModule

T0 = 1796083200  # 2026-12-01 00:00 UTC
ROLES = dict(label_column="click", dense_columns=["n"], categorical_columns=["ad"], event_time_column="when")


def write_logs(tmp_path, seed=0, b_rows=90):
    """Two files in name order, each spanning several hours, with late records (an event
    time of an hour already passed), a line without an event time, and a late record at the
    start of the second file. Returns each file's path and its records (n, event time or None)."""
    rng = np.random.default_rng(seed)
    files, n = [], 0
    for name, (lo, hi), count in [("a.csv", (0, 3), 70), ("b.csv.gz", (2, 6), b_rows)]:
        times = np.sort(T0 + rng.integers(lo * 3600, hi * 3600, count))
        late = rng.random(count) < 0.15
        times[late] -= rng.integers(0, 2 * 3600, late.sum())  # read after later ones
        records = [[n + i, int(t)] for i, t in enumerate(times)]
        n += count
        if name.startswith("b"):
            records[0][1] = T0 + 5  # the first hour, read long after it ended
        records[count // 3][1] = None  # a bad line: no event time
        text = "click,n,ad,when\n" + "".join(
            f"{int(rng.random() < 0.3)},{k},a{rng.integers(0, 40)},{'' if t is None else t}\n" for k, t in records)
        path = tmp_path / name
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
        files.append((str(path), records))
    return files


def expected_slices(files, window):
    """An independent reading of the rule: in read order, a record's slice is the window of
    the newest event time read up to it; a record without one is a bad line (not read) and
    the slice goes on. Returns {window start: [n of each record read]}."""
    out, newest = {}, None
    for _, records in files:
        for n, t in records:
            if t is None:
                continue
            newest = t // window if newest is None else max(newest, t // window)
            out.setdefault(newest * window, []).append(n)
    return out


def read_ns(parts, rank=0, world_size=1, batch_size=7, unreadable=None):
    fmt = DelimitedFormat(**ROLES)
    dataset = LogStreamDataset([p.path for p in parts], fmt, batch_size=batch_size, files=parts, rank=rank,
                               world_size=world_size, max_bad_fraction=None,
                               bad_files="fail" if unreadable is None else "skip")
    loader = BatchDataLoader(dataset)
    out = [int(x) for batch in loader for x in batch.dense[:, 0].tolist()]
    if unreadable is not None:
        unreadable.update(loader.unreadable_files)
    return out


@pytest.mark.parametrize("window", [3600, 7200])
def test_slices_hold_each_record_in_the_window_of_the_newest_event_time_read(tmp_path, window):
    files = write_logs(tmp_path)
    fmt = DelimitedFormat(**ROLES)
    indexes = index_log_files([p for p, _ in files], fmt)
    slices = cut_event_time_slices(indexes, fmt, window, settings="test", cache_dir=str(tmp_path / "index"))
    expected = expected_slices(files, window)
    assert [s.start for s in slices] == list(expected)
    assert len(slices) >= 3
    for s in slices:
        assert read_ns(list(s.parts)) == expected[s.start]
        # Two ranks read the slice between them, every record once.
        assert sorted(read_ns(list(s.parts), 0, 2) + read_ns(list(s.parts), 1, 2)) == expected[s.start]
    assert slices[0].name == "2026-12-01T00:00:00Z"
    assert any(len(s.parts) == 2 for s in slices)  # a slice that goes on into the next file

    # The cuts are cached: a second cut reads no file.
    def unread(*args, **kwargs):
        raise AssertionError("read again")

    original, event_time_slices.file_windows = event_time_slices.file_windows, unread
    try:
        again = cut_event_time_slices(indexes, fmt, window, settings="test", cache_dir=str(tmp_path / "index"))
    finally:
        event_time_slices.file_windows = original
    assert again == slices


def test_an_online_run_trains_each_window_and_validates_on_the_next(tmp_path):
    files = write_logs(tmp_path)
    expected = expected_slices(files, 3600)
    starts = list(expected)
    seen: dict[int, dict[str, list[int]]] = {}

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.setdefault(trainer.current_epoch, {}).setdefault("train", []).extend(
                int(x) for x in batch.dense[:, 0].tolist())

        def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            seen.setdefault(trainer.current_epoch, {}).setdefault("val", []).extend(
                int(x) for x in batch.dense[:, 0].tolist())

    dm = DelimitedDataModule(train_paths=[p for p, _ in files], online=True, slice_every="1h", batch_size=8,
                             max_bad_fraction=None, index_dir=str(tmp_path / "index"), **ROLES)
    progressive = ProgressiveValidation()
    model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, num_dense_features=1, num_embeddings=100,
                       embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    pl.Trainer(max_epochs=3, reload_dataloaders_every_n_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
               callbacks=[Record(), progressive]).fit(model, datamodule=dm)
    for epoch in range(3):
        assert seen[epoch]["train"] == expected[starts[epoch]]
        assert sorted(seen[epoch]["val"]) == sorted(expected[starts[epoch + 1]])
    assert [h["event_time"] for h in progressive.history] == [float(s) for s in starts[:3]]
    assert [h["name"] for h in progressive.history] == [
        "2026-12-01T00:00:00Z", "2026-12-01T01:00:00Z", "2026-12-01T02:00:00Z"]


def test_a_resume_inside_a_window_reads_exactly_the_rest_of_it(tmp_path):
    files = write_logs(tmp_path, seed=1)
    expected = expected_slices(files, 3600)
    second = expected[list(expected)[1]]
    assert len(second) > 16

    def run(callbacks, max_epochs, ckpt_path=None):
        seen = []

        class Record(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                seen.extend((trainer.current_epoch, int(x)) for x in batch.dense[:, 0].tolist())

        dm = DelimitedDataModule(train_paths=[p for p, _ in files], online=True, slice_every="1h", batch_size=4,
                                 max_bad_fraction=None, index_dir=str(tmp_path / "index"), **ROLES)
        model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, num_dense_features=1, num_embeddings=100,
                           embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
        pl.Trainer(max_epochs=max_epochs, reload_dataloaders_every_n_epochs=1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   limit_val_batches=0, default_root_dir=tmp_path, callbacks=[Record(), *callbacks]).fit(
            model, datamodule=dm, ckpt_path=ckpt_path)
        return seen

    first_epoch = -(-len(expected[list(expected)[0]]) // 4)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=first_epoch + 3, save_top_k=-1)
    unbroken = run([ckpt], max_epochs=2)
    resumed = run([], max_epochs=2, ckpt_path=str(tmp_path / "ckpt" / f"epoch=1-step={first_epoch + 3}.ckpt"))
    assert resumed == [(1, n) for n in second[12:]]
    assert unbroken[-len(resumed):] == resumed


def test_bad_settings_are_refused_by_name(tmp_path):
    files = write_logs(tmp_path)
    with pytest.raises(ValueError, match="slice_every='1h' cuts online mode's time slices by event time: set online"):
        DelimitedDataModule(train_paths=[files[0][0]], slice_every="1h", **ROLES)
    with pytest.raises(ValueError, match="slice_every 'hourly' is not a duration of event time"):
        DelimitedDataModule(train_paths=[files[0][0]], online=True, slice_every="hourly", **ROLES)
    criteo = write_synthetic_criteo(tmp_path / "day_0.tsv", rows=50, seed=0)
    dm = CriteoDataModule(train_paths=[str(criteo)], online=True, slice_every="1h", index_dir=str(tmp_path / "i"))
    with pytest.raises(ValueError, match=rf"{criteo}: slice_every cuts .* but CriteoFormat reads none: set the "
                                         rf"reader's event_time_column \(or partition_time=True"):
        dm.setup("fit")
    one_hour = tmp_path / "one.csv"
    one_hour.write_text("click,n,ad,when\n1,0,a,1796083200\n0,1,b,1796083300\n")
    dm = DelimitedDataModule(train_paths=[str(one_hour)], online=True, slice_every="1d",
                             index_dir=str(tmp_path / "i"), **ROLES)
    with pytest.raises(ValueError, match=r"online mode needs at least two time slices: .* span 1 window of "
                                         r"slice_every '1d'"):
        dm.setup("fit")


def test_a_file_that_breaks_off_keeps_its_whole_records_and_its_break_in_its_last_part(tmp_path):
    files = write_logs(tmp_path, b_rows=8000)  # over the 64 KiB a compressed file is read in
    broken = files[1][0]
    data = open(broken, "rb").read()
    open(broken, "wb").write(data[: len(data) * 2 // 3])  # a gzip stream cut short
    common = dict(train_paths=[p for p, _ in files], online=True, slice_every="1h", batch_size=8,
                  max_bad_fraction=None, index_dir=str(tmp_path / "index"), **ROLES)
    with pytest.raises(UnreadableFileError, match=rf"{broken}: unreadable from record \d+ on"):
        DelimitedDataModule(**common).setup("fit")  # bad_files="fail": at set-up, before any training
    dm = DelimitedDataModule(bad_files="skip", **common)
    dm.setup("fit")
    whole = dm._indexes[broken].records
    parts = [p for s in dm.event_time_slices for p in s.parts if p.path == broken]
    assert 0 < whole < len(files[1][1]) and sum(p.records for p in parts) == whole
    assert parts[-1].unreadable is not None and all(p.unreadable is None for p in parts[:-1])
    unreadable = {}
    ns = [n for s in dm.event_time_slices for n in read_ns(list(s.parts), unreadable=unreadable)]
    kept = [(path, records if path != broken else records[:whole]) for path, records in files]
    assert sorted(ns) == sorted(n for window in expected_slices(kept, 3600).values() for n in window)
    assert unreadable == {broken: whole + 1}  # the first record not read, counted in the whole file
    # A file with no whole record at all still carries its break into a slice.
    open(broken, "wb").write(data[:20])
    dm = DelimitedDataModule(bad_files="skip", **{**common, "index_dir": str(tmp_path / "index2")})
    dm.setup("fit")
    (part,) = [p for s in dm.event_time_slices for p in s.parts if p.path == broken]
    assert part.records == 0 and part.unreadable is not None


def test_a_resume_with_another_slice_every_is_refused(tmp_path):
    files = write_logs(tmp_path)

    def fit(slice_every, ckpt_path=None):
        dm = DelimitedDataModule(train_paths=[p for p, _ in files], online=True, slice_every=slice_every,
                                 batch_size=16, max_bad_fraction=None, index_dir=str(tmp_path / "index"), **ROLES)
        model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, num_dense_features=1, num_embeddings=100,
                           embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
        pl.Trainer(max_epochs=1, reload_dataloaders_every_n_epochs=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                   default_root_dir=tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)]
                   ).fit(model, datamodule=dm, ckpt_path=ckpt_path)

    fit("1h")
    with pytest.raises(ValueError, match="checkpoint's time slices were cut with slice_every='1h', this run's with "
                                         "'2h'"):
        fit("2h", ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
