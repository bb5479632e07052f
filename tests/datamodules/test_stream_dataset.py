import gzip
import random
import re
import shutil

import pytest
import torch

from ctr_lightning.datamodules import (AvazuDataModule, BadLineError, CriteoDataModule, ParquetDataModule,
                                       SyntheticCriteoDataModule)
from ctr_lightning.datamodules.bad_lines import UnreadableFileError
from ctr_lightning.datamodules.criteo import CriteoFormat
from ctr_lightning.datamodules.batch_loader import BatchDataLoader
from ctr_lightning.datamodules.row_index import build_file_index
from ctr_lightning.datamodules.stream_dataset import LogStreamDataset

from .test_criteo import reference_rows


def rows_of(batches):
    """Each example as a hashable tuple (label, dense..., ids...)."""
    out = []
    for b in batches:
        n = len(b)
        ids = b.sparse.values().reshape(26, n).T.numpy()
        for i in range(n):
            out.append((float(b.labels[i]), *b.dense[i].tolist(), *ids[i].tolist()))
    return out


def reference_tuples(path):
    labels, dense, ids = reference_rows(path)
    return [(float(labels[i]), *dense[i].tolist(), *ids[i].tolist()) for i in range(len(labels))]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # 3 on purpose
def test_every_example_read_by_exactly_one_rank_and_worker(criteo_sample, tmp_path):
    # Unequal files, one of them gzip, one with fewer lines than there are readers.
    big = criteo_sample.big
    head = criteo_sample.head
    shutil.copy(big, tmp_path / "day_0.tsv")
    with open(head, "rb") as f, gzip.open(tmp_path / "day_1.tsv.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    tiny = tmp_path / "day_2.tsv"
    tiny.write_text("".join(head.read_text().splitlines(keepends=True)[:5]))
    files = [str(tmp_path / "day_0.tsv"), str(tmp_path / "day_1.tsv.gz"), str(tiny)]
    seen = []
    for rank in range(2):
        ds = LogStreamDataset(files, CriteoFormat(block_size=1 << 16), batch_size=97, rank=rank, world_size=2,
                              bad_lines="raise")
        seen += rows_of(BatchDataLoader(ds, num_workers=3))
    want = reference_tuples(big) + reference_tuples(head) + reference_tuples(head)[:5]
    assert len(seen) == len(want) == 4584 + 1999 + 5
    assert sorted(seen) == sorted(want)


HEX = re.compile(r"^[0-9a-fA-F]{8}$")
COUNT = re.compile(r"^[+-]?[0-9]{1,18}$")


def is_good(line: str) -> bool:
    fields = line.split("\t")
    return (len(fields) == 40 and fields[0] in ("0", "1")
            and all(f == "" or COUNT.match(f) for f in fields[1:14])
            and all(f == "" or HEX.match(f) for f in fields[14:]))


def corrupt(line: str, rng: random.Random) -> str:
    fields = line.split("\t")
    kind = rng.randrange(10)
    if kind == 0:
        del fields[rng.randrange(len(fields))]
    elif kind == 1:
        fields.insert(rng.randrange(len(fields)), "x")
    elif kind == 2:  # a character inside a categorical field
        j = rng.randrange(14, 40)
        fields[j] = (fields[j] or "0") [:-1] + rng.choice("gz-. \x00G")
    elif kind == 3:  # a count that is not an integer
        fields[rng.randrange(1, 14)] = rng.choice(["1.5", "abc", "-", "+", " 3", "1e3", "99999999999999999999"])
    elif kind == 4:
        fields[0] = rng.choice(["2", "", "01", "yes", "-1"])
    elif kind == 5:  # truncated line
        return line[: rng.randrange(len(line))]
    elif kind == 6:
        return ""
    elif kind == 7:  # a hex field of the wrong length
        j = rng.randrange(14, 40)
        fields[j] = fields[j][: rng.randrange(1, 8)] if fields[j] else "abc"
    elif kind == 8:  # random bytes anywhere (never a line break)
        chars = list(line)
        for _ in range(rng.randrange(1, 4)):
            chars[rng.randrange(len(chars))] = rng.choice("\tq#;,\"'\\\x01 ")
        return "".join(chars)
    else:  # a change that may well leave the line valid
        j = rng.randrange(14, 40)
        if fields[j]:
            fields[j] = fields[j][:-1] + rng.choice("0123456789abcdefABCDEF")
    return "\t".join(fields)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_corruptions_never_crash_and_are_all_counted(criteo_sample, tmp_path, seed):
    rng = random.Random(seed)
    good_lines = (criteo_sample.head).read_text().splitlines()
    lines, expected_bad, good_kept = [], 0, []
    for i in range(1200):  # 600 corrupted lines per seed, 1200 over both
        if i % 2:
            bad = corrupt(rng.choice(good_lines), rng)
            lines.append(bad)
            if is_good(bad):
                good_kept.append(bad)
            else:
                expected_bad += 1
        else:
            lines.append(good_lines[i // 2])
            good_kept.append(good_lines[i // 2])
    path = tmp_path / "corrupt.tsv"
    path.write_text("\n".join(lines) + "\n")
    clean = tmp_path / "clean.tsv"
    clean.write_text("\n".join(good_kept) + "\n")

    ds = LogStreamDataset([str(path)], CriteoFormat(block_size=1 << 14), batch_size=64, bad_lines="skip")
    got = rows_of(BatchDataLoader(ds, num_workers=0))
    assert ds.bad_line_log.total == expected_bad
    assert sorted(got) == sorted(reference_tuples(clean))


def _truncated_gzip(source, path):
    """``source`` gzipped, then cut in the middle of the compressed stream."""
    packed = gzip.compress(source.read_bytes())
    path.write_bytes(packed[: len(packed) // 2])
    return path


def test_a_truncated_gzip_file_fails_naming_the_file_and_the_record(criteo_sample, tmp_path):
    truncated = _truncated_gzip(criteo_sample.head, tmp_path / "b_truncated.tsv.gz")
    (tmp_path / "a_empty.tsv").write_bytes(b"")
    files = [f"file://{tmp_path / 'a_empty.tsv'}", str(truncated)]
    message = (rf"^{re.escape(str(truncated))}: unreadable from record \d+ on \(EOFError: .*\); "
               r"bad_files='skip' would use its first \d+ records")
    with pytest.raises(UnreadableFileError, match=message):
        list(BatchDataLoader(LogStreamDataset(files, CriteoFormat(block_size=1 << 14), batch_size=100)))
    # Whatever the bad-line policy: a file cut short is not a bad line.
    with pytest.raises(UnreadableFileError) as error:
        list(BatchDataLoader(LogStreamDataset(files, CriteoFormat(), batch_size=100, bad_lines="raise")))
    assert isinstance(error.value, BadLineError)
    assert 1 < error.value.record < 1999
    index = build_file_index(str(truncated))
    assert index.unreadable.startswith("EOFError") and index.records == error.value.record - 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_files_skip_reads_exactly_the_intact_prefix_and_counts_the_file(criteo_sample, tmp_path, caplog,
                                                                              num_workers):
    truncated = _truncated_gzip(criteo_sample.head, tmp_path / "b_truncated.tsv.gz")
    (tmp_path / "a_empty.tsv").write_bytes(b"")
    files = [f"file://{tmp_path / 'a_empty.tsv'}", str(truncated)]
    with pytest.raises(UnreadableFileError) as error:
        LogStreamDataset(files, CriteoFormat(), batch_size=100)
    intact = error.value.record - 1  # records before the break, as the failing run named it
    with caplog.at_level("ERROR"):
        ds = LogStreamDataset(files, CriteoFormat(block_size=1 << 14), batch_size=100, bad_files="skip")
        loader = BatchDataLoader(ds, num_workers=num_workers)
        got = rows_of(loader)
    prefix = tmp_path / "prefix.tsv"
    prefix.write_text("".join(criteo_sample.head.read_text().splitlines(keepends=True)[:intact]))
    assert got == reference_tuples(prefix)
    # Counted once, as a file cut short (with where), not as a bad line; and logged with both.
    assert loader.unreadable_files == {str(truncated): intact + 1}
    assert dict(loader.bad_line_counts) == {}
    assert f"{truncated}: unreadable from record {intact + 1} on (EOFError" in caplog.text
    assert f"its first {intact} records are read" in caplog.text


def test_bad_files_is_checked_by_every_datamodule(tmp_path):
    for make in (lambda **kw: LogStreamDataset([], CriteoFormat(), batch_size=1, **kw), CriteoDataModule,
                 AvazuDataModule, lambda **kw: ParquetDataModule(categorical_columns=["ad"], **kw),
                 lambda **kw: SyntheticCriteoDataModule(data_dir=str(tmp_path), **kw)):
        with pytest.raises(ValueError, match="bad_files must be 'fail' or 'skip', got 'ignore'"):
            make(bad_files="ignore")
        make(bad_files="skip")


@pytest.mark.parametrize("compressed", [False, True])
def test_a_file_of_nothing_but_wrong_width_lines_is_counted_or_raised(tmp_path, compressed):
    # Every line has 41 fields: the parser accepts none, so no record batch ever arrives;
    # the lines must still be counted (once, over all readers of the file) or raised.
    lines = ["\t".join(["1"] + ["3"] * 13 + ["68fd1e64"] * 27) for _ in range(500)]
    text = ("\n".join(lines) + "\n").encode()
    path = tmp_path / ("wide.tsv.gz" if compressed else "wide.tsv")
    path.write_bytes(gzip.compress(text) if compressed else text)
    ds = LogStreamDataset([str(path)], CriteoFormat(block_size=1 << 12), batch_size=64, bad_lines="skip")
    loader = BatchDataLoader(ds, num_workers=2)
    assert list(loader) == []
    assert dict(loader.bad_line_counts) == {str(path): 500}
    raising = LogStreamDataset([str(path)], CriteoFormat(block_size=1 << 12), batch_size=64, bad_lines="raise")
    with pytest.raises(BadLineError, match=f"{re.escape(str(path))}:1: expected 40 fields, found 41"):
        list(BatchDataLoader(raising))


def _write_layouts(tmp_path):
    """(a) one Parquet file of one row group, (b) a tiny and a huge text file, (c) gzip
    files of different sizes; each record's label column carries a unique number."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ctr_lightning.datamodules.parquet import ParquetFormat

    rng = np.random.default_rng(0)
    n = 700
    table = pa.table({"click": rng.integers(0, 2, n), "row": np.arange(n), "ad": rng.integers(0, 50, n)})
    pq.write_table(table, tmp_path / "one_group.parquet")  # < 1M rows: a single row group
    parquet = ([str(tmp_path / "one_group.parquet")], ParquetFormat("click", ["row"], ["ad"]))

    def criteo_lines(start, count):
        return "".join(f"{i % 2}\t{i}" + "\t" * 12 + "\tabcdef01" * 26 + "\n" for i in range(start, start + count))

    (tmp_path / "tiny.tsv").write_text(criteo_lines(0, 3))
    (tmp_path / "huge.tsv").write_text(criteo_lines(3, 1500))
    text = ([str(tmp_path / "tiny.tsv"), str(tmp_path / "huge.tsv")], CriteoFormat(block_size=1 << 12))
    sizes = [5, 400, 90]
    paths, start = [], 0
    for k, size in enumerate(sizes):
        path = tmp_path / f"part{k}.tsv.gz"
        path.write_bytes(gzip.compress(criteo_lines(start, size).encode()))
        paths.append(str(path))
        start += size
    return {"parquet": (parquet, n), "text": (text, 1503), "gzip": ((paths, CriteoFormat(block_size=1 << 12)), 495)}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return _write_layouts(tmp_path_factory.mktemp("layouts"))


@pytest.mark.parametrize("layout", ["parquet", "text", "gzip"])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_every_row_once_and_equal_steps_for_any_files(layouts, layout, num_workers):
    (paths, fmt), rows = layouts[layout]
    batch = 32
    for world in (1, 2, 3, 4):
        seen, steps = [], []
        for rank in range(world):
            ds = LogStreamDataset(paths, fmt, batch_size=batch, rank=rank, world_size=world, bad_lines="raise")
            batches = list(BatchDataLoader(ds, num_workers=num_workers))
            steps.append(len(batches))
            # The unique number of each record: the first dense column (log1p of it for Criteo).
            numbers = torch.cat([b.dense[:, 0] for b in batches])
            seen += (numbers if layout == "parquet" else torch.expm1(numbers)).round().long().tolist()
        # Ranks cut the same number of batches within one, so the equal-steps rule drops at
        # most one (partial) batch per rank; here nothing is dropped at all.
        assert max(steps) - min(steps) <= 1, (world, steps)
        assert sorted(seen) == list(range(rows)), world
