import gzip
import math
import shutil

import numpy as np
import pytest
import torch

from ctr_lightning import Batch
from ctr_lightning.datamodules import BadLineError, CriteoDataModule
from ctr_lightning.datamodules.field_decoders import MISSING_VALUE
from ctr_lightning.hashing import feature_ids


def reference_rows(path):
    """An independent line-by-line decoder of the Criteo raw layout."""
    labels, dense, ids = [], [], []
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            assert len(fields) == 40
            labels.append(float(fields[0]))
            dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]])
            ids.append([
                int(feature_ids(np.array([int(x, 16) if x else int(MISSING_VALUE)], dtype=np.uint64), f)[0])
                for f, x in enumerate(fields[14:])
            ])
    return np.array(labels, np.float32), np.array(dense, np.float32), np.array(ids, np.int64)


def collect(dm, split="train"):
    dm.setup("fit" if split in ("train", "val") else split)
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    labels, dense, ids = [], [], []
    for batch in loader:
        assert isinstance(batch, Batch)
        n = len(batch)
        assert batch.sparse.keys() == [f"C{i}" for i in range(1, 27)]
        assert batch.sparse.lengths().tolist() == [1] * (26 * n)
        labels.append(batch.labels.numpy())
        dense.append(batch.dense.numpy())
        ids.append(batch.sparse.values().reshape(26, n).T.numpy())
    return np.concatenate(labels), np.concatenate(dense), np.concatenate(ids)


def sort_rows(labels, dense, ids):
    order = np.lexsort(ids.T[::-1])
    return labels[order], dense[order], ids[order]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reads_sample_exactly(criteo_sample, num_workers):
    path = criteo_sample.big
    dm = CriteoDataModule(train_paths=[str(path)], batch_size=1000, num_workers=num_workers, bad_lines="raise")
    got = collect(dm)
    want = reference_rows(path)
    assert len(got[0]) == 4584
    if num_workers == 0:  # one reader keeps file order
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)
    else:  # workers interleave batches; the multiset of rows must be identical
        for g, w in zip(sort_rows(*got), sort_rows(*want)):
            np.testing.assert_allclose(g, w, rtol=1e-6)


def test_negative_counts_are_zero_or_bad_lines_by_choice(criteo_sample, tmp_path):
    path = criteo_sample.big
    lines = path.read_text().splitlines()
    negative = [i for i, line in enumerate(lines) if any(x.startswith("-") for x in line.split("\t")[1:14])]
    assert negative  # I2 has negative values, in the real logs as in the synthetic ones
    labels, dense, _ = collect(CriteoDataModule(train_paths=[str(path)], batch_size=1000, bad_lines="raise"))
    assert len(labels) == len(lines) and dense.min() >= 0.0
    # The synthetic counts go negative in other columns than I2 too: no limit on the bad share here.
    strict = CriteoDataModule(train_paths=[str(path)], batch_size=1000, negative_counts="bad", max_bad_fraction=None)
    labels, _, ids = collect(strict)
    assert len(labels) == len(lines) - len(negative)
    kept = np.delete(reference_rows(path)[2], negative, axis=0)
    np.testing.assert_array_equal(ids, kept)  # exactly the lines without a negative count
    first = negative[0]
    column = next(j for j, x in enumerate(lines[first].split("\t")[1:14], 1) if x.startswith("-"))
    raising = CriteoDataModule(train_paths=[str(path)], batch_size=1000, negative_counts="bad", bad_lines="raise")
    with pytest.raises(BadLineError, match=f"{path}:{first + 1}: I{column} is not a non-negative integer"):
        collect(raising)
    with pytest.raises(ValueError, match="negative_counts must be 'clamp' or 'bad'"):
        CriteoDataModule(train_paths=[str(path)], negative_counts="drop")


def test_spot_values_and_missing_fields(criteo_sample):
    path = criteo_sample.head
    lines = path.read_text().splitlines()
    dm = CriteoDataModule(train_paths=[str(path)], batch_size=4096)
    labels, dense, ids = collect(dm)
    assert len(labels) == len(lines) == 1999
    assert labels.mean() == pytest.approx(sum(l.startswith("1") for l in lines) / 1999)
    for row in (0, 1, 500, 1998):
        fields = lines[row].split("\t")
        for j in range(13):
            want = math.log1p(max(int(fields[1 + j]), 0)) if fields[1 + j] else 0.0
            assert dense[row, j] == pytest.approx(want, rel=1e-6)
        for f in range(26):
            raw = fields[14 + f]
            value = int(raw, 16) if raw else int(MISSING_VALUE)
            assert ids[row, f] == feature_ids(np.array([value], dtype=np.uint64), f)[0]
    # Missing categorical fields map to one id per feature, distinct from every real value.
    missing_rows = [i for i, l in enumerate(lines) if l.split("\t")[14 + 21] == ""]
    assert missing_rows, "the sample has rows with C22 missing"
    assert len({ids[i, 21] for i in missing_rows}) == 1
    assert (ids >= 0).all()


def test_train_and_val_split_by_file(criteo_sample):
    dm = CriteoDataModule(
        train_paths=[str(criteo_sample.big)],
        val_paths=[str(criteo_sample.head)],
        batch_size=512,
    )
    assert len(collect(dm, "train")[0]) == 4584
    assert len(collect(dm, "val")[0]) == 1999


def test_gzip_and_directories(criteo_sample, tmp_path):
    src = criteo_sample.head
    with open(src, "rb") as f, gzip.open(tmp_path / "day_1.tsv.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    shutil.copy(src, tmp_path / "day_0.tsv")
    dm = CriteoDataModule(train_paths=[str(tmp_path)], batch_size=700, num_workers=2)
    got = collect(dm)
    want = reference_rows(src)
    assert len(got[0]) == 2 * 1999
    doubled = tuple(np.concatenate([w, w]) for w in want)
    for g, w in zip(sort_rows(*got), sort_rows(*doubled)):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_missing_path_names_it(tmp_path):
    dm = CriteoDataModule(train_paths=[str(tmp_path / "nope" / "day_0.tsv")])
    with pytest.raises(FileNotFoundError, match="nope/day_0.tsv"):
        dm.setup("fit")


def _write_with_bad_lines(criteo_sample, tmp_path):
    lines = (criteo_sample.head).read_text().splitlines()[:300]
    lines[10] = "\t".join(lines[10].split("\t")[:30])  # too few fields
    lines[20] = lines[20].replace("\t", "\tzz", 1)  # I1 not an integer
    fields = lines[30].split("\t")
    fields[14] = "xyz12345"  # invalid hex
    lines[30] = "\t".join(fields)
    lines[40] = "7" + lines[40][1:]  # label not 0/1
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_lines_skip_counts_and_keeps_good_rows(criteo_sample, tmp_path, caplog):
    path = _write_with_bad_lines(criteo_sample, tmp_path)
    dm = CriteoDataModule(train_paths=[str(path)], batch_size=64, bad_lines="skip")
    with caplog.at_level("WARNING"):
        labels, _, _ = collect(dm)
    assert len(labels) == 296
    assert "skipped 4 bad lines" in caplog.text
    assert f"{path}:11" in caplog.text and f"{path}:31" in caplog.text


@pytest.mark.parametrize("line,reason", [(11, "expected 40 fields, found 30"), (21, "I1 is not an integer")])
def test_bad_lines_raise_names_file_and_line(criteo_sample, tmp_path, line, reason):
    path = _write_with_bad_lines(criteo_sample, tmp_path)
    text = path.read_text().splitlines()
    if line == 21:  # make the first problem the one under test
        text[10] = (criteo_sample.head).read_text().splitlines()[10]
        path.write_text("\n".join(text) + "\n")
    dm = CriteoDataModule(train_paths=[str(path)], batch_size=64, bad_lines="raise")
    with pytest.raises(BadLineError, match=f"{path}:{line}: {reason}"):
        collect(dm)


def test_batches_move_as_one_unit():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["C1", "C2"], values=torch.tensor([3, 4, 5]),
                                              lengths=torch.tensor([1, 1, 1, 0]))
    batch = Batch(dense=torch.zeros(2, 13), sparse=kjt, labels=torch.tensor([0.0, 1.0]))
    # The meta device stands in for a GPU: every tensor, the KJT's included, must move.
    moved = batch.to("meta")
    tensors = [moved.dense, moved.labels, moved.sparse.values(), moved.sparse.lengths(), moved.sparse.offsets()]
    assert all(t.device.type == "meta" for t in tensors)
    assert [t.dtype for t in tensors] == [torch.float32, torch.float32, torch.int64, torch.int64, torch.int64]
    assert len(moved) == 2 and moved.sparse.keys() == ["C1", "C2"] and moved.sparse.stride() == 2
    assert batch.sparse.values().device.type == "cpu"  # the original stays where it was


def test_unlabeled_files_of_39_fields_are_scored_with_empty_labels_and_refused_for_training(criteo_sample, tmp_path):
    from lightning.pytorch import Trainer

    from ctr_lightning.callbacks import ScoreWriter
    from ctr_lightning.models import DeepFMModule

    # Kaggle's test.txt layout: the label column dropped. A 40-field line (record 5) is a
    # bad line of this file, as a 39-field one is of a labeled file.
    lines = criteo_sample.head.read_text().splitlines()[:300]
    unlabeled = [line.split("\t", 1)[1] for line in lines]
    unlabeled[5] = lines[5]
    path = tmp_path / "test.txt"
    path.write_text("\n".join(unlabeled) + "\n")
    labeled = tmp_path / "labeled.tsv"
    labeled.write_text("\n".join(lines[:5] + [unlabeled[6]] + lines[6:]) + "\n")
    with pytest.raises(BadLineError, match=f"{path}:6: expected 39 fields, found 40"):
        dm = CriteoDataModule(predict_paths=[str(path)], bad_lines="raise")
        dm.setup("predict")
        list(dm.predict_dataloader())
    with pytest.raises(BadLineError, match=f"{labeled}:6: expected 40 fields, found 39"):
        collect(CriteoDataModule(train_paths=[str(labeled)], bad_lines="raise"))

    dm = CriteoDataModule(predict_paths=[str(path)], batch_size=64)
    dm.setup("predict")
    batches = list(dm.predict_dataloader())
    records = np.concatenate([b.records.numpy() for b in batches])
    assert records.tolist() == [r for r in range(300) if r != 5]
    assert np.isnan(np.concatenate([b.labels.numpy() for b in batches])).all()
    _, want_dense, want_ids = reference_rows(criteo_sample.head)
    np.testing.assert_allclose(np.concatenate([b.dense.numpy() for b in batches]), want_dense[records], rtol=1e-6)
    got_ids = np.concatenate([b.sparse.values().reshape(26, len(b)).T.numpy() for b in batches])
    np.testing.assert_array_equal(got_ids, want_ids[records])

    writer = ScoreWriter(str(tmp_path / "scores"))
    model = DeepFMModule(embedding_dim=4, num_embeddings=1000, deep_layer_sizes=[8])
    Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
            enable_progress_bar=False, callbacks=[writer]).predict(model, datamodule=dm, return_predictions=False)
    scored = [line.split("\t") for line in (tmp_path / "scores" / "scores-rank00000.tsv").read_text().splitlines()]
    assert [int(r[0]) for r in scored[1:]] == records.tolist()
    assert {r[1] for r in scored[1:]} == {""}
    with pytest.raises(BadLineError, match=f"{path}: 39 tab-separated fields a line, no label .*only predict_paths"):
        collect(CriteoDataModule(train_paths=[str(path)]))
