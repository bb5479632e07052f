import csv
import gzip
import io

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from ctr_lightning.datamodules import BadLineError, DelimitedDataModule, DelimitedFormat, ParquetDataModule
from ctr_lightning.datamodules.batch_loader import BatchDataLoader
from ctr_lightning.datamodules.format_hints import format_hint
from ctr_lightning.datamodules.stream_dataset import LogStreamDataset

COLUMNS = ["click", "price", "age", "ad", "site", "tags", "user", "when", "unused"]
ROLES = dict(label_column="click", dense_columns=["price", "age"], categorical_columns=["ad", "site"],
             multi_hot_columns=["tags"], group_column="user", event_time_column="when")


def make_rows(n, seed, timestamps):
    """Rows as text fields: integer and string categoricals (empties, the delimiter inside
    quotes), dense with empties, multi-hot lists, a user and an event time."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        when = 1_796_000_000 + int(rng.integers(0, 10**6))
        rows.append([
            str(int(rng.random() < 0.3)),
            "" if rng.random() < 0.1 else repr(float(rng.random() * 10)),
            str(int(rng.integers(-5, 80))),
            str(int(rng.integers(-10**12, 10**12))),
            "" if rng.random() < 0.1 else f"site {rng.integers(0, 50)}, {rng.integers(0, 3)}",
            "|".join(f"t{x}" for x in rng.integers(0, 30, rng.integers(0, 4))),
            f"u{rng.integers(0, 20)}",
            np.datetime_as_string(np.datetime64(when, "s")).replace("T", " ") if timestamps else str(when),
            "x",
        ])
    return rows


def write_csv(path, rows, header=True, line_end="\n", delimiter=","):
    out = io.StringIO()
    writer = csv.writer(out, delimiter=delimiter, lineterminator=line_end)
    if header:
        writer.writerow(COLUMNS)
    writer.writerows(rows)
    data = out.getvalue().encode()
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)


def to_parquet(csv_path, parquet_path):
    """The same data as Parquet, converted with pyarrow (multi-hot text split into lists)."""
    table = pacsv.read_csv(csv_path, convert_options=pacsv.ConvertOptions(column_types={"tags": pa.string()}))
    tags = table.column("tags")
    lists = pc.if_else(pc.equal(tags, ""), pa.scalar(None, pa.list_(pa.string())), pc.split_pattern(tags, "|"))
    pq.write_table(table.set_column(COLUMNS.index("tags"), "tags", lists), parquet_path, row_group_size=70)


def batches(dm, split="train"):
    dm.setup({"train": "fit", "predict": "predict"}[split])
    return list(dm.train_dataloader() if split == "train" else dm.predict_dataloader())


def assert_same_batches(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.labels.tolist() == b.labels.tolist()
        assert a.dense.tolist() == b.dense.tolist()  # bit for bit
        assert a.sparse.values().tolist() == b.sparse.values().tolist()
        assert a.sparse.lengths().tolist() == b.sparse.lengths().tolist()
        assert a.groups.tolist() == b.groups.tolist()
        assert a.event_time.tolist() == b.event_time.tolist()


@pytest.mark.parametrize("header, line_end, name, timestamps, num_workers", [
    (True, "\r\n", "log.csv", True, 0),
    (False, "\n", "log.csv.gz", False, 2),
])
def test_same_batches_as_parquet_of_the_same_rows(tmp_path, header, line_end, name, timestamps, num_workers):
    rows = make_rows(300, seed=1, timestamps=timestamps)
    reference = tmp_path / "reference.csv"
    write_csv(reference, rows)
    to_parquet(reference, tmp_path / "log.parquet")
    write_csv(tmp_path / name, rows, header=header, line_end=line_end)
    roles = ROLES if header else {role: ([COLUMNS.index(c) for c in value] if isinstance(value, list)
                                         else str(COLUMNS.index(value))) for role, value in ROLES.items()}
    common = dict(batch_size=64, num_workers=num_workers, bad_lines="raise", index_dir=str(tmp_path / "index"))
    ours = batches(DelimitedDataModule(train_paths=[str(tmp_path / name)], header=header, **roles, **common))
    theirs = batches(ParquetDataModule(train_paths=[str(tmp_path / "log.parquet")], **ROLES, **common))
    assert sum(len(b) for b in ours) == 300
    assert_same_batches(ours, theirs)


def test_files_with_other_column_orders_and_another_delimiter(tmp_path):
    rows = make_rows(50, seed=2, timestamps=False)
    write_csv(tmp_path / "a.tsv", rows, delimiter="\t")
    order = [COLUMNS.index(c) for c in reversed(COLUMNS)]
    (tmp_path / "b.tsv").write_text("\t".join(COLUMNS[k] for k in order) + "\n"
                                    + "".join("\t".join(row[k] for k in order) + "\n" for row in rows))
    common = dict(batch_size=50, delimiter="\t", index_dir=str(tmp_path / "index"), bad_lines="raise", **ROLES)
    a = batches(DelimitedDataModule(train_paths=[str(tmp_path / "a.tsv")], **common))
    b = batches(DelimitedDataModule(train_paths=[str(tmp_path / "b.tsv")], **common))
    assert_same_batches(a, b)
    assert a[0].sparse.keys() == ["ad", "site", "tags"]


def test_multi_hot_bags_and_quoted_fields(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text('label,ad,tags\n1,"a,b",x|y|x\n0,"",\n1,7,"p|q"\n')
    dm = DelimitedDataModule(train_paths=[str(path)], categorical_columns=["ad"], multi_hot_columns=["tags"],
                             batch_size=8, index_dir=str(tmp_path / "index"), bad_lines="raise")
    (batch,) = batches(dm)
    tags = batch.sparse["tags"]
    assert tags.lengths().tolist() == [3, 0, 2]
    x, y, _, p, q = tags.values().tolist()
    assert len({x, y, p, q}) == 4 and tags.values().tolist()[2] == x
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]


def test_bad_lines_are_named_by_file_and_line(tmp_path):
    path = tmp_path / "log.csv"
    lines = ["click,price,ad", '1,2.5,"a,b"', "2,1,a", "0,abc,b", "1,3,c,extra", '0,,"x,y"', "1,1,d"]
    path.write_text("\n".join(lines) + "\n")
    roles = dict(label_column="click", dense_columns=["price"], categorical_columns=["ad"],
                 index_dir=str(tmp_path / "index"), max_bad_fraction=None, batch_size=16)
    # A block's lines of the wrong width are met before its values are decoded.
    with pytest.raises(BadLineError, match=rf"{path}:5: expected 3 fields, found 4: '1,3,c,extra'"):
        batches(DelimitedDataModule(train_paths=[str(path)], bad_lines="raise", **roles))
    dm = DelimitedDataModule(train_paths=[str(path)], bad_lines="skip", **roles)
    (batch,) = batches(dm)
    assert batch.dense[:, 0].tolist() == [2.5, 0.0, 1.0]
    assert dm.bad_line_counts == {str(path): 3}
    del lines[4]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadLineError, match=rf"{path}:3: click is not 0 or 1: '2,1,a'"):
        batches(DelimitedDataModule(train_paths=[str(path)], bad_lines="raise", **roles))
    lines[2] = "1,1,a"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadLineError, match=rf"{path}:4: price is not a number: '0,abc,b'"):
        batches(DelimitedDataModule(train_paths=[str(path)], bad_lines="raise", **roles))


def test_predict_reads_unlabeled_files_and_training_refuses_them(tmp_path):
    no_label = tmp_path / "no_label.csv"
    no_label.write_text('ad,price\n"a,x",1\nb,2,3\nc,3\n')  # its second record of the wrong width
    empty_labels = tmp_path / "empty_labels.csv"
    empty_labels.write_text("click,ad,price\n,a,1\n,b,2\n")
    roles = dict(label_column="click", dense_columns=["price"], categorical_columns=["ad"], batch_size=2,
                 index_dir=str(tmp_path / "index"))
    got = batches(DelimitedDataModule(predict_paths=[str(no_label), str(empty_labels)], **roles), "predict")
    assert np.isnan(np.concatenate([b.labels.numpy() for b in got])).all()
    assert np.concatenate([b.records.numpy() for b in got]).tolist() == [0, 2, 3, 4]
    with pytest.raises(BadLineError, match=r"no label column 'click'.*only predict_paths may be unlabeled"):
        batches(DelimitedDataModule(train_paths=[str(no_label)], **roles))
    with pytest.raises(BadLineError, match=r"empty labels in column 'click'; only predict_paths may be unlabeled"):
        batches(DelimitedDataModule(train_paths=[str(empty_labels)], **roles))


def test_event_times_and_a_missing_one(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("click,ad,when\n1,a,1796000000\n0,b,2026-12-01T05:00:00Z\n1,c,\n0,d,yesterday\n1,e,-5\n")
    roles = dict(categorical_columns=["ad"], event_time_column="when", label_column="click",
                 index_dir=str(tmp_path / "index"), batch_size=8, max_bad_fraction=None)
    with pytest.raises(BadLineError, match=rf"{path}:4: when \(the event time\) is missing"):
        batches(DelimitedDataModule(train_paths=[str(path)], bad_lines="raise", **roles))
    (batch,) = batches(DelimitedDataModule(train_paths=[str(path)], **roles))
    assert batch.event_time.tolist() == [1796000000, 1796101200, -5]


def test_columns_it_cannot_find_are_named(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("click,ad\n1,a\n")
    with pytest.raises(BadLineError, match=rf"{path}:1: no column \['site'\] in its header \['click', 'ad'\]"):
        batches(DelimitedDataModule(train_paths=[str(path)], label_column="click", categorical_columns=["ad", "site"],
                                    index_dir=str(tmp_path / "index")))
    parquet = tmp_path / "log.parquet"
    pq.write_table(pa.table({"click": [1], "ad": ["a"]}), parquet)
    with pytest.raises(BadLineError, match=rf"{parquet}:1: no column .*read it with ParquetDataModule"):
        batches(DelimitedDataModule(train_paths=[str(parquet)], label_column="click", categorical_columns=["ad"],
                                    index_dir=str(tmp_path / "index")))
    with pytest.raises(ValueError, match="header=False names columns by 0-based position"):
        DelimitedDataModule(header=False, label_column="click", categorical_columns=[1])
    with pytest.raises(BadLineError, match=rf"{path}:1: categorical column 5 is past its 2 fields"):
        batches(DelimitedDataModule(train_paths=[str(path)], header=False, label_column=0, categorical_columns=[5],
                                    index_dir=str(tmp_path / "index")))


def test_mid_epoch_resume_reads_exactly_the_rest(tmp_path):
    path = tmp_path / "log.csv.gz"
    write_csv(path, make_rows(230, seed=3, timestamps=False))
    fmt = DelimitedFormat(**ROLES)

    def ids(skip):
        dataset = LogStreamDataset([str(path)], fmt, batch_size=40, skip_batches=skip)
        return [row for batch in BatchDataLoader(dataset) for row in batch.sparse.values().tolist()]

    everything, rest = ids(None), ids({0: 2})
    assert len(rest) < len(everything) and everything[-len(rest):] == rest


def test_the_criteo_reader_points_an_unknown_layout_to_this_one():
    assert format_hint(b"a;b;c\n1;2;3\n", "CriteoFormat") == (
        "The file is none of the Criteo, Avazu or Parquet layouts: read it with DelimitedDataModule (its first line "
        "has 3 semicolon-separated fields).")
    assert "(its first line has 2 tab-separated fields)" in format_hint(b"a\tb\n", "AvazuFormat")
    assert format_hint(b"a;b;c\n", "DelimitedFormat") == ""
    assert format_hint(b"PAR1...", "CriteoFormat").endswith("read it with ParquetDataModule.")
