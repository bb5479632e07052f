import gzip
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctr_lightning.datamodules import BadLineError
from ctr_lightning.datamodules import row_index, sources
from ctr_lightning.datamodules.row_index import HeaderIf, RowIndexCache, build_file_index


@pytest.fixture
def small_marks(monkeypatch):
    monkeypatch.setattr(row_index, "MARK_EVERY", 4)
    monkeypatch.setattr(sources, "MARK_EVERY", 4)


@pytest.mark.parametrize("header_lines", [0, 1])
@pytest.mark.parametrize("final_newline", [True, False])
def test_counts_records_and_marks_every_kth_start(tmp_path, small_marks, header_lines, final_newline):
    lines = [f"line{i}" + "x" * (i % 7) for i in range(23)]
    data = ("\n".join(lines) + ("\n" if final_newline else "")).encode()
    path = tmp_path / "a.tsv"
    path.write_bytes(data)
    index = build_file_index(str(path), header_lines)
    starts = [0] + [i + 1 for i, c in enumerate(data) if c == 10 and i + 1 < len(data)]
    assert index.kind == "text" and index.records == 23 - header_lines
    assert list(index.marks) == [starts[header_lines + r] for r in range(0, 23 - header_lines, 4)]
    assert index.head == data[:1024]
    packed = tmp_path / "a.tsv.gz"
    packed.write_bytes(gzip.compress(data))
    gz = build_file_index(str(packed), header_lines)
    assert (gz.kind, gz.records, gz.marks, gz.head) == ("compressed", 23 - header_lines, (), data[:1024])


@pytest.mark.parametrize("has_header", [True, False])
@pytest.mark.parametrize("suffix", [".csv", ".csv.gz"])
def test_a_header_rule_is_decided_per_file_from_its_first_line(tmp_path, small_marks, has_header, suffix):
    lines = (["id,click"] if has_header else []) + [f"{i},{i % 2}" for i in range(10)]
    data = ("\n".join(lines) + "\n").encode()
    path = tmp_path / f"a{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    rule = HeaderIf((b"id,click", b"id"))
    index = build_file_index(str(path), rule)
    assert (index.records, index.header_lines) == (10, int(has_header))
    if suffix == ".csv":  # the marks start at the first record, past the header where there is one
        starts = [0] + [i + 1 for i, c in enumerate(data) if c == 10 and i + 1 < len(data)]
        assert list(index.marks) == [starts[int(has_header) + r] for r in range(0, 10, 4)]
    # The rule is part of the cache key: a cached count under another rule is not served.
    cache = RowIndexCache(tmp_path / "cache")
    assert cache.get(str(path), rule).header_lines == int(has_header)
    assert cache.get(str(path), 0).header_lines == 0 and cache.get(str(path), rule) == index
    empty = tmp_path / "empty.csv"
    empty.write_bytes(b"")
    assert (build_file_index(str(empty), rule).records, build_file_index(str(empty), rule).header_lines) == (0, 0)


def test_empty_files_and_parquet_row_groups(tmp_path):
    (tmp_path / "empty.tsv").write_bytes(b"")
    assert build_file_index(str(tmp_path / "empty.tsv")).records == 0
    table = pa.table({"click": [0, 1] * 50, "ad": list(range(100))})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=30)
    index = build_file_index(str(tmp_path / "p.parquet"), columnar=True)
    assert (index.kind, index.records, index.groups) == ("parquet", 100, (30, 30, 30, 10))
    (tmp_path / "fake.parquet").write_text("id,click,hour\n1,0,14102100\n")
    with pytest.raises(BadLineError, match=r"fake.parquet: not a Parquet file .*Avazu CSV header"):
        build_file_index(str(tmp_path / "fake.parquet"), columnar=True)


def test_the_cache_serves_counts_until_the_file_changes(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_text("a\nb\n")
    cache = RowIndexCache(tmp_path / "cache")
    assert cache.get(str(path)).records == 2
    assert len(list((tmp_path / "cache").iterdir())) == 1
    # Served from the cache: a counted file's entry is used without reading the file.
    entry = next((tmp_path / "cache").iterdir())
    entry.write_text(entry.read_text().replace('"records": 2', '"records": 7'))
    assert cache.get(str(path)).records == 7
    # A changed file (size and modification time) is counted again.
    path.write_text("a\nb\nc\n")
    os.utime(path, (time.time() + 5, time.time() + 5))
    assert cache.get(str(path)).records == 3
    # An unusable directory costs the recount only.
    (tmp_path / "blocked").write_text("a file where the directory should be")
    assert RowIndexCache(tmp_path / "blocked" / "cache").get(str(path)).records == 3
