import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ctr_lightning.datamodules import BadLineError, ParquetDataModule, ParquetFormat
from ctr_lightning.datamodules.bad_lines import UnreadableFileError
from ctr_lightning.datamodules.batch_loader import BatchDataLoader
from ctr_lightning.datamodules.stream_dataset import LogStreamDataset

from .test_avazu import fnv_id, small_id

SCHEMA = dict(label_column="click", dense_columns=["price", "age"], categorical_columns=["ad", "site"],
              multi_hot_columns=["interests", "tags"])


def make_rows(n, seed):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        rows.append({
            "click": int(rng.random() < 0.3),
            "price": None if rng.random() < 0.1 else float(rng.random() * 10),
            "age": int(rng.integers(18, 80)),
            "ad": None if rng.random() < 0.1 else int(rng.integers(0, 10**12)),
            "site": None if rng.random() < 0.1 else f"site{rng.integers(0, 50)}",
            "interests": None if rng.random() < 0.1 else [int(x) for x in rng.integers(0, 1000, rng.integers(0, 5))],
            "tags": [f"t{x}" for x in rng.integers(0, 30, rng.integers(0, 4))],
            "unused": "x",
        })
    return rows


def write(path, rows, row_group_size):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def expected(row):
    ad = small_id(row["ad"] if row["ad"] is not None else np.iinfo(np.int64).min % 2**64, 0)  # as uint64
    site = fnv_id((row["site"] or "").encode(), 1)
    interests = tuple(small_id(x, 2) for x in (row["interests"] or []))
    tags = tuple(fnv_id(t.encode(), 3) for t in row["tags"])
    dense = (np.float32(row["price"] or 0.0).item(), float(row["age"]))
    return (float(row["click"]), dense, ad, site, interests, tags)


def got_rows(batches):
    out = []
    for b in batches:
        n = len(b)
        jt = b.sparse.to_dict()
        ad, site = jt["ad"].values().tolist(), jt["site"].values().tolist()
        interests = [tuple(x.tolist()) for x in jt["interests"].to_dense()]
        tags = [tuple(x.tolist()) for x in jt["tags"].to_dense()]
        for i in range(n):
            out.append((float(b.labels[i]), tuple(b.dense[i].tolist()), ad[i], site[i], interests[i], tags[i]))
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reads_schema_exactly_across_ranks_workers_and_row_groups(tmp_path, num_workers):
    rows_a, rows_b = make_rows(700, 0), make_rows(333, 1)
    write(tmp_path / "part-0.parquet", rows_a, row_group_size=64)
    write(tmp_path / "part-1.parquet", rows_b, row_group_size=100)
    files = [str(tmp_path / "part-0.parquet"), str(tmp_path / "part-1.parquet")]
    seen = []
    for rank in range(2):
        ds = LogStreamDataset(files, ParquetFormat(**SCHEMA), batch_size=50, rank=rank, world_size=2,
                              bad_lines="raise")
        seen += got_rows(BatchDataLoader(ds, num_workers=num_workers))
    want = [expected(r) for r in rows_a + rows_b]
    assert len(seen) == len(want) == 1033
    assert sorted(seen) == sorted(want)


def test_datamodule_and_bad_rows(tmp_path):
    rows = make_rows(200, 2)
    rows[37]["click"] = None
    rows[90]["click"] = 3
    write(tmp_path / "logs.parquet", rows, row_group_size=50)
    dm = ParquetDataModule(train_paths=[str(tmp_path / "logs.parquet")], batch_size=64, **SCHEMA)
    dm.setup("fit")
    assert dm.sparse_feature_names == ["ad", "site", "interests", "tags"] and dm.num_dense_features == 2
    assert sum(len(b) for b in dm.train_dataloader()) == 198
    strict = ParquetDataModule(train_paths=[str(tmp_path / "logs.parquet")], bad_lines="raise", **SCHEMA)
    with pytest.raises(BadLineError, match=r"logs.parquet:38: click is not 0 or 1"):
        strict.setup("fit")
        list(strict.train_dataloader())
    wrong = ParquetDataModule(train_paths=[str(tmp_path / "logs.parquet")], label_column="clicked",
                              categorical_columns=["ad"])
    wrong.setup("fit")
    with pytest.raises(BadLineError, match=r"missing label column 'clicked'; it has .*only predict_paths may be unlabeled"):
        list(wrong.train_dataloader())


def _damage_row_group(path, group):
    """Zeroes bytes in the middle of a column chunk of ``group``: the footer stays intact
    (the file's index counts all its rows), so the damage shows only when that group is read."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = min(o for o in (chunk.dictionary_page_offset, chunk.data_page_offset) if o is not None)
    data = bytearray(path.read_bytes())
    middle = start + chunk.total_compressed_size // 2
    data[middle - 16:middle + 16] = bytes(32)
    path.write_bytes(bytes(data))
    damaged = pq.ParquetFile(path)
    for g in range(damaged.num_row_groups):
        if g != group:
            damaged.read_row_group(g)
    with pytest.raises(OSError):
        damaged.read_row_group(group)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_damaged_row_group_fails_from_the_reader_or_is_skipped(tmp_path, num_workers):
    rows = make_rows(300, 3)
    path = tmp_path / "logs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100, compression="zstd")
    _damage_row_group(path, group=2)
    # The break is met by a reader (in a worker process, with workers) and reaches this process.
    failing = LogStreamDataset([str(path)], ParquetFormat(**SCHEMA), batch_size=50)
    with pytest.raises(UnreadableFileError, match=rf"{re.escape(str(path))}: unreadable from record 201 on "
                                                  r"\(OSError: .*\); bad_files='skip' would use its first 200"):
        list(BatchDataLoader(failing, num_workers=num_workers))
    skipping = LogStreamDataset([str(path)], ParquetFormat(**SCHEMA), batch_size=50, bad_files="skip")
    loader = BatchDataLoader(skipping, num_workers=num_workers)
    assert got_rows(loader) == [expected(r) for r in rows[:200]]
    assert loader.unreadable_files == {str(path): 201} and dict(loader.bad_line_counts) == {}


@pytest.mark.parametrize("kind", ["seconds", "timestamp"])
def test_event_times_come_from_a_column_or_the_hive_partitions(tmp_path, kind):
    rows = make_rows(120, 5)
    for i, row in enumerate(rows):
        row["ts"] = 1_796_000_000 + 37 * i
    rows[11]["ts"] = None  # a row without its event time is a bad row
    table = pa.Table.from_pylist(rows)
    if kind == "timestamp":
        ms = pa.array([None if r["ts"] is None else r["ts"] * 1000 + 999 for r in rows], pa.timestamp("ms"))
        table = table.set_column(table.schema.get_field_index("ts"), "ts", ms)
    part = tmp_path / "dt=2026-12-01" / "hour=05"
    part.mkdir(parents=True)
    pq.write_table(table, part / "p.parquet", row_group_size=50)
    dm = ParquetDataModule(train_paths=[str(part / "p.parquet")], batch_size=32, event_time_column="ts", **SCHEMA)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    want = [r["ts"] for r in rows if r["ts"] is not None]
    assert [int(t) for b in batches for t in b.event_time] == want
    by_partition = ParquetDataModule(train_paths=[str(part / "p.parquet")], batch_size=32, partition_time=True,
                                     **SCHEMA)
    by_partition.setup("fit")
    times = torch.cat([b.event_time for b in by_partition.train_dataloader()])
    assert len(times) == 120 and set(times.tolist()) == {1796101200}  # 2026-12-01 05:00 UTC
    write(tmp_path / "flat.parquet", make_rows(10, 6), row_group_size=10)
    flat = ParquetDataModule(train_paths=[str(tmp_path / "flat.parquet")], partition_time=True, **SCHEMA)
    flat.setup("fit")
    with pytest.raises(ValueError, match=r"flat.parquet: partition_time=True .* this path has none"):
        list(flat.train_dataloader())
