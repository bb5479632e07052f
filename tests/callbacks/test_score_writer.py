import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch import Trainer

from ctr_lightning.callbacks import ScoreWriter, StreamProgressBar
from ctr_lightning.datamodules import CriteoDataModule, write_synthetic_criteo
from ctr_lightning.models import DeepFMModule


def with_bad_lines(source, path, wrong_width_at, bad_label_at):
    """A copy of a Criteo file with a short line put in, and a line's label made 7, at the
    given 0-based record positions (of the new file, which has one record more)."""
    lines = source.read_text().splitlines()
    good = iter(lines)
    out = []
    for i in range(len(lines) + 1):
        if i == wrong_width_at:
            out.append("1\t2\t3")
        elif i == bad_label_at:
            out.append("7" + next(good)[1:])
        else:
            out.append(next(good))
    path.write_text("\n".join(out) + "\n")
    return path


def trainer(*callbacks):
    return Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
                   callbacks=list(callbacks))


@pytest.mark.parametrize(("file_format", "num_workers"), [("tsv", 0), ("parquet", 2)])
def test_predict_writes_one_score_per_good_record_numbered_across_files(tmp_path, file_format, num_workers):
    first = write_synthetic_criteo(tmp_path / "a.tsv", rows=700, seed=3, max_cardinality=1000)
    second = with_bad_lines(write_synthetic_criteo(tmp_path / "b0.tsv", rows=500, seed=4, stream=1,
                                                   max_cardinality=1000), tmp_path / "b.tsv", 37, 401)
    dm = CriteoDataModule(predict_paths=[str(first), str(second)], batch_size=128, num_workers=num_workers)
    torch.manual_seed(0)
    model = DeepFMModule(embedding_dim=4, num_embeddings=1000, deep_layer_sizes=[8])
    writer = ScoreWriter(str(tmp_path / "scores"), file_format=file_format, rows_per_write=300)
    bar = StreamProgressBar()
    assert trainer(writer, bar).predict(model, datamodule=dm, return_predictions=False) is None

    path = tmp_path / "scores" / f"scores-rank00000.{file_format}"
    assert not list((tmp_path / "scores").glob("*.partial"))
    if file_format == "tsv":
        table = np.genfromtxt(path, delimiter="\t", names=True)
        rows, labels, scores = table["row"].astype(np.int64), table["label"], table["score"]
    else:
        table = pq.read_table(path).to_pydict()
        rows, labels, scores = (np.asarray(table[c]) for c in ("row", "label", "score"))
    # Every record of both files but the two bad ones (records 700+37 and 700+401), once.
    assert sorted(rows.tolist()) == [r for r in range(1201) if r not in (737, 1101)]
    assert writer.rows_written == 1199
    # The scores are the model's, the labels the file's, matched by record number.
    expected = {}
    model.eval()
    for batch in dm.predict_dataloader():
        assert batch.records is not None
        with torch.no_grad():
            for r, y, s in zip(batch.records.tolist(), batch.labels.tolist(), torch.sigmoid(model(batch)).tolist()):
                expected[r] = (y, s)
    for r, y, s in zip(rows.tolist(), labels.tolist(), scores.tolist()):
        assert y == expected[r][0] and s == pytest.approx(expected[r][1], rel=1e-6)
    lines_b = second.read_text().splitlines()
    assert float(lines_b[800 - 700].split("\t")[0]) == expected[800][0]
    # The bar knew the total before the pass: 1,201 records in batches of 128.
    assert bar.predict_progress_bar.total == 10 == bar.predict_progress_bar.n


def test_a_new_pass_removes_files_an_earlier_one_left_that_it_would_not_write(tmp_path):
    data = write_synthetic_criteo(tmp_path / "a.tsv", rows=100, seed=3, max_cardinality=1000)
    out = tmp_path / "scores"
    out.mkdir()
    for stale in ("scores-rank00003.tsv", "scores-rank00000.parquet", "scores-rank00001.tsv.partial"):
        (out / stale).write_text("old")
    (out / "notes.txt").write_text("mine")
    model = DeepFMModule(embedding_dim=4, num_embeddings=1000, deep_layer_sizes=[8])
    trainer(ScoreWriter(str(out))).predict(model, datamodule=CriteoDataModule(predict_paths=[str(data)]),
                                           return_predictions=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "scores-rank00000.tsv"]


def test_predict_refuses_a_file_named_twice(tmp_path):
    data = write_synthetic_criteo(tmp_path / "a.tsv", rows=100, seed=3, max_cardinality=1000)
    dm = CriteoDataModule(predict_paths=[str(data), str(data)])
    dm.setup("predict")
    with pytest.raises(ValueError, match="more than once"):
        dm.predict_dataloader()


def test_score_writer_rejects_an_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="file_format"):
        ScoreWriter(str(tmp_path), file_format="csv")


def test_unlabeled_parquet_is_scored_with_null_labels_and_refused_for_training(tmp_path):
    import pyarrow as pa

    from ctr_lightning.datamodules import BadLineError, ParquetDataModule
    from ctr_lightning.models import WideDeepModule

    rng = np.random.default_rng(0)
    path = tmp_path / "new_traffic.parquet"
    pq.write_table(pa.table({"price": rng.random(300), "ad": rng.integers(0, 50, 300)}), path)
    schema = dict(label_column="click", dense_columns=["price"], categorical_columns=["ad"], batch_size=64)
    model = WideDeepModule(sparse_feature_names=["ad"], num_dense_features=1, embedding_dim=4, num_embeddings=100,
                           deep_layer_sizes=[4])
    writer = ScoreWriter(str(tmp_path / "scores"), file_format="parquet")
    trainer(writer).predict(model, datamodule=ParquetDataModule(predict_paths=[str(path)], **schema),
                            return_predictions=False)
    table = pq.read_table(tmp_path / "scores" / "scores-rank00000.parquet")
    assert table.column("row").to_pylist() == list(range(300))
    assert table.column("label").null_count == 300
    with pytest.raises(BadLineError, match=f"{path}: missing label column 'click'.*only predict_paths may be unlabeled"):
        Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                max_steps=2).fit(model, datamodule=ParquetDataModule(train_paths=[str(path)], **schema))
