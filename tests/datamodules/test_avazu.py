import datetime
import gzip
import shutil

import numpy as np
import pytest

from ctr_lightning.datamodules import AvazuDataModule, BadLineError
from ctr_lightning.datamodules.avazu import AVAZU_SPARSE
from ctr_lightning.datamodules.field_decoders import feature_salt
from ctr_lightning.hashing import splitmix64


def fnv_id(value: bytes, feature: int) -> int:
    h = 0xCBF29CE484222325
    for byte in value:
        h = ((h ^ byte) * 0x100000001B3) & (2**64 - 1)
    return int(splitmix64(np.array([h], dtype=np.uint64) ^ feature_salt(feature))[0]) & (2**63 - 1)


def small_id(value: int, feature: int) -> int:
    return int(splitmix64(np.array([value], dtype=np.uint64) ^ feature_salt(feature))[0]) & (2**63 - 1)


def reference(path):
    lines = path.read_text().splitlines()[1:]
    labels, ids = [], []
    for line in lines:
        f = line.split(",")
        when = datetime.datetime.strptime("20" + f[2], "%Y%m%d%H")
        row = [small_id(when.hour, 0), small_id(when.weekday(), 1)]
        row += [fnv_id(v.encode(), 2 + k) for k, v in enumerate(f[3:])]
        labels.append(float(f[1]))
        ids.append(row)
    return np.array(labels, np.float32), np.array(ids, np.int64)


def collect(dm):
    dm.setup("fit")
    labels, ids = [], []
    for batch in dm.train_dataloader():
        n = len(batch)
        assert batch.dense.shape == (n, 0)
        assert batch.sparse.keys() == list(AVAZU_SPARSE)
        labels.append(batch.labels.numpy())
        ids.append(batch.sparse.values().reshape(len(AVAZU_SPARSE), n).T.numpy())
    return np.concatenate(labels), np.concatenate(ids)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reads_avazu_sample_exactly(avazu_sample, tmp_path, num_workers):
    # Two copies, one gzip: the header of each is consumed, in every shard of either.
    shutil.copy(avazu_sample, tmp_path / "a.csv")
    with open(avazu_sample, "rb") as f, gzip.open(tmp_path / "b.csv.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    dm = AvazuDataModule(train_paths=[str(tmp_path)], batch_size=32, num_workers=num_workers, bad_lines="raise")
    labels, ids = collect(dm)
    want_labels, want_ids = reference(avazu_sample)
    assert len(labels) == 200
    got = sorted(zip(labels.tolist(), map(tuple, ids.tolist())))
    want = sorted(zip(want_labels.tolist() * 2, map(tuple, want_ids.tolist() * 2)))
    assert got == want


def test_bad_hour_and_header_name_file_and_line(avazu_sample, tmp_path):
    lines = avazu_sample.read_text().splitlines()
    fields = lines[5].split(",")
    fields[2] = "14109900"
    lines[5] = ",".join(fields)
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadLineError, match=f"{path}:6: hour is not YYMMDDHH"):
        collect(AvazuDataModule(train_paths=[str(path)], bad_lines="raise"))
    labels, _ = collect(AvazuDataModule(train_paths=[str(path)], bad_lines="skip"))
    assert len(labels) == 99
    headless = tmp_path / "headless.csv"
    headless.write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(BadLineError, match=f"{headless}:5: hour is not YYMMDDHH"):  # line 1 is a record
        collect(AvazuDataModule(train_paths=[str(headless)], bad_lines="raise"))
    with pytest.raises(BadLineError, match=f"{headless}:1: expected the Avazu header"):
        collect(AvazuDataModule(train_paths=[str(headless)], header=True))
    # header=False: the header line of a file is a record, and a bad one.
    with pytest.raises(BadLineError, match=f"{path}:1: click is not 0 or 1"):
        collect(AvazuDataModule(train_paths=[str(path)], header=False, bad_lines="raise"))


def test_header_less_files_are_read_in_the_standard_column_order(avazu_sample, tmp_path):
    # With and without the header, plain and gzip, in two workers: each file's records are
    # counted, sliced and read alike, whichever its first line is.
    text = avazu_sample.read_text()
    headless = text.split("\n", 1)[1]
    (tmp_path / "a.csv").write_text(text)
    (tmp_path / "b.csv").write_text(headless)
    with gzip.open(tmp_path / "c.csv.gz", "wt") as g:
        g.write(headless)
    (tmp_path / "d.csv").write_bytes(b"\xef\xbb\xbf" + text.encode())  # a spreadsheet's byte order mark
    dm = AvazuDataModule(train_paths=[str(tmp_path)], batch_size=32, num_workers=2, bad_lines="raise")
    labels, ids = collect(dm)
    assert [(i.records, i.header_lines) for i in dm._indexes.values()] == [(100, 1), (100, 0), (100, 0), (100, 1)]
    want_labels, want_ids = reference(avazu_sample)
    got = sorted(zip(labels.tolist(), map(tuple, ids.tolist())))
    assert got == sorted(zip(want_labels.tolist() * 4, map(tuple, want_ids.tolist() * 4)))


def test_the_test_layout_without_click_is_scored_with_empty_labels_and_refused_for_training(avazu_sample, tmp_path):
    import lightning.pytorch as pl

    from ctr_lightning.callbacks import ScoreWriter
    from ctr_lightning.models import WideDeepModule

    # Avazu's test file: no click column (23 columns), with its header or without.
    rows = [line.split(",") for line in avazu_sample.read_text().splitlines()]
    test_lines = [",".join(f[:1] + f[2:]) for f in rows]
    with_header = tmp_path / "test.csv"
    with_header.write_text("\n".join(test_lines) + "\n")
    headless = tmp_path / "test_headless.csv"
    headless.write_text("\n".join(test_lines[1:11] + ["1,2,3"] + test_lines[11:]) + "\n")  # a short line: record 10
    model = WideDeepModule(sparse_feature_names=list(AVAZU_SPARSE), num_dense_features=0, embedding_dim=4,
                           num_embeddings=100, deep_layer_sizes=[4])
    writer = ScoreWriter(str(tmp_path / "scores"))
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[writer])
    dm = AvazuDataModule(predict_paths=[str(with_header), str(headless)], batch_size=64)
    trainer.predict(model, datamodule=dm, return_predictions=False)
    scored = [line.split("\t") for line in (tmp_path / "scores" / "scores-rank00000.tsv").read_text().splitlines()]
    assert scored[0] == ["row", "label", "score"]
    assert sorted(int(r[0]) for r in scored[1:]) == [r for r in range(201) if r != 110]
    assert {r[1] for r in scored[1:]} == {""}
    with pytest.raises(BadLineError, match=f"{headless}: no click column .*only predict_paths may be unlabeled"):
        collect(AvazuDataModule(train_paths=[str(headless)]))


def test_a_damaged_first_line_does_not_decide_a_header_less_files_layout(avazu_sample, tmp_path):
    lines = avazu_sample.read_text().splitlines()[1:]
    fields = lines[0].split(",")
    damaged = ",".join(fields[:1] + fields[2:])  # one field short: the test layout's width
    (tmp_path / "a.csv").write_text("\n".join([damaged] + lines[1:]) + "\n")
    dm = AvazuDataModule(train_paths=[str(tmp_path / "a.csv")], batch_size=32)
    labels, _ = collect(dm)
    assert len(labels) == 99  # trained on the other lines; the first is a counted bad line
    assert dm.bad_line_counts == {str(tmp_path / "a.csv"): 1}
