"""A file given to the wrong reader is refused with a message naming the reader that fits:
every layout the readers know, and an unknown one, against every reader."""

import gzip

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctr_lightning.datamodules import AvazuDataModule, CriteoDataModule, ParquetDataModule, write_synthetic_criteo
from ctr_lightning.datamodules.format_hints import format_hint

from ..conftest import write_avazu_layout

ROWS = 30  # more than the 10 bad lines a file may hold before its reader stops


def criteo(path, labeled=True):
    write_synthetic_criteo(path, rows=ROWS, seed=0, max_cardinality=100)
    if not labeled:  # Kaggle's test.txt: no label column
        path.write_text("".join(line.split("\t", 1)[1] for line in path.read_text().splitlines(keepends=True)))
    return path


def avazu(path, header=True, labeled=True):
    lines = write_avazu_layout(path, rows=ROWS, seed=0).read_text().splitlines()
    if not labeled:  # Avazu's test file: no click column
        lines = [",".join(f[:1] + f[2:]) for f in (line.split(",") for line in lines)]
    path.write_text("\n".join(lines[0 if header else 1 :]) + "\n")
    return path


def parquet(path):
    pq.write_table(pa.table({"click": [0, 1] * (ROWS // 2), "ad": list(range(ROWS))}), path)
    return path


def delimited(path, sep):
    path.write_text("".join(sep.join(str(i * 7 + j) for j in range(7)) + "\n" for i in range(ROWS)))
    return path


# layout: (how to write a file of it, the reader that fits, its text for the unknown layouts)
LAYOUTS = {
    "criteo": (criteo, "CriteoDataModule"),
    "criteo-unlabeled": (lambda p: criteo(p, labeled=False), "CriteoDataModule"),
    "avazu": (avazu, "AvazuDataModule"),
    "avazu-header-less": (lambda p: avazu(p, header=False), "AvazuDataModule"),
    "avazu-test": (lambda p: avazu(p, labeled=False), "AvazuDataModule"),
    "avazu-test-header-less": (lambda p: avazu(p, header=False, labeled=False), "AvazuDataModule"),
    "parquet": (parquet, "ParquetDataModule"),
    "comma-separated": (lambda p: delimited(p, ","), "DelimitedDataModule (its first line has 7 comma-separated"),
    "tab-separated": (lambda p: delimited(p, "\t"), "DelimitedDataModule (its first line has 7 tab-separated"),
}
READERS = {
    "CriteoDataModule": CriteoDataModule,
    "AvazuDataModule": AvazuDataModule,
    "ParquetDataModule": lambda **kw: ParquetDataModule(label_column="click", categorical_columns=["ad"], **kw),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_is_read_by_its_reader_and_refused_by_the_others_naming_it(tmp_path, layout, reader):
    write, fits = LAYOUTS[layout]
    path = write(tmp_path / "data")  # no telling suffix: the bytes alone say what it is
    if fits == reader:  # predict reads the unlabeled layouts too
        dm = READERS[reader](predict_paths=[str(path)], batch_size=8, bad_lines="raise")
        dm.setup("predict")
        assert sum(len(batch) for batch in dm.predict_dataloader()) == ROWS
        return
    dm = READERS[reader](train_paths=[str(path)], batch_size=8)
    with pytest.raises(Exception) as error:  # at setup, or once the reader meets the lines
        dm.setup("fit")
        for _ in dm.train_dataloader():
            pass
    message = str(error.value)
    assert str(path) in message and f"read it with {fits}" in message


def test_a_gzip_file_without_its_suffix_is_named_as_such(tmp_path):
    path = tmp_path / "day_0.tsv"
    with gzip.open(path, "wb") as g:
        g.write(criteo(tmp_path / "src.tsv").read_bytes())
    assert format_hint(path.read_bytes()[:1024], "CriteoFormat") == (
        "The file is gzip-compressed but its name does not end in .gz.")
    with pytest.raises(Exception, match="gzip-compressed but its name does not end in .gz"):
        dm = CriteoDataModule(train_paths=[str(path)], batch_size=8)
        dm.setup("fit")
        list(dm.train_dataloader())


def test_binary_and_empty_heads_get_no_delimited_hint():
    assert format_hint(b"", "CriteoFormat") == ""
    assert format_hint(b"\x00\x01\x02,\t", "CriteoFormat") == ""
    assert format_hint(b"just words\n", "CriteoFormat").endswith(
        "DelimitedDataModule (its first line has no comma, tab, semicolon or pipe).")
