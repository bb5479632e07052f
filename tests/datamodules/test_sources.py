import gzip

import pytest

from ctr_lightning.datamodules import sources
from ctr_lightning.datamodules.row_index import build_file_index
from ctr_lightning.datamodules.sources import FileSlice, time_slices


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("header_lines", [0, 1])
def test_a_slice_opens_on_exactly_its_records(tmp_path, monkeypatch, compressed, header_lines):
    monkeypatch.setattr(sources, "MARK_EVERY", 5)
    lines = [f"{i}\t" + "x" * (i % 11) for i in range(47)]
    data = ("\n".join(lines)).encode()  # no final newline
    path = tmp_path / ("f.tsv.gz" if compressed else "f.tsv")
    path.write_bytes(gzip.compress(data) if compressed else data)
    monkeypatch.setattr("ctr_lightning.datamodules.row_index.MARK_EVERY", 5)
    index = build_file_index(str(path), header_lines)
    records = lines[header_lines:]
    for first, stop in [(0, None), (0, 1), (3, 17), (5, 10), (11, 42 - header_lines), (40, None), (46 - header_lines,
                                                                                                    None)]:
        piece = FileSlice(str(path), first, stop, header_lines, index.marks)
        with piece.open() as f:
            got = f.read().decode().split("\n")
        want = records[first:stop]
        assert [g for g in got if g] == want, (first, stop)


def test_time_slices_follow_hive_partitions_then_files():
    files = ["logs/dt=2026-12-02/part-1.parquet", "logs/dt=2026-12-01/part-0.parquet",
             "logs/dt=2026-12-02/part-0.parquet", "logs/dt=2026-12-10/hr=03/part-0.parquet"]
    assert time_slices(files) == [["logs/dt=2026-12-01/part-0.parquet"],
                                  ["logs/dt=2026-12-02/part-0.parquet", "logs/dt=2026-12-02/part-1.parquet"],
                                  ["logs/dt=2026-12-10/hr=03/part-0.parquet"]]
    assert time_slices(["day_1.tsv", "day_0.tsv"]) == [["day_0.tsv"], ["day_1.tsv"]]
