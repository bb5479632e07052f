"""The one-pass Criteo parser: line framing that differs from a plain ``split("\n")``."""

import io

import numpy as np
import pytest

from ctr_lightning.datamodules.criteo import CriteoFormat
from ctr_lightning.datamodules.sources import FileSlice, line_blocks
from ctr_lightning.datamodules.batch_loader import BatchDataLoader
from ctr_lightning.datamodules.stream_dataset import LogStreamDataset

from .test_criteo import reference_rows
from .test_stream_dataset import reference_tuples, rows_of


def _read(path, block_size, bad_lines="raise"):
    ds = LogStreamDataset([str(path)], CriteoFormat(block_size=block_size), batch_size=50, bad_lines=bad_lines)
    return rows_of(BatchDataLoader(ds)), ds


@pytest.mark.parametrize("block_size", [1, 100, 1 << 16])
def test_crlf_and_no_final_newline_read_like_plain_lines(criteo_sample, tmp_path, block_size):
    lines = (criteo_sample.head).read_text().splitlines()[:120]
    plain = tmp_path / "plain.tsv"
    plain.write_text("\n".join(lines) + "\n")
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(("\r\n".join(lines)).encode())  # Windows endings, and none after the last line
    got, _ = _read(crlf, block_size)  # block_size 1: every line is longer than a block
    assert got == reference_tuples(plain)


def test_line_blocks_end_on_newlines_and_keep_every_byte():
    data = b"".join(b"x" * n + b"\n" for n in range(0, 300, 7)) + b"tail"
    for block_size in (1, 5, 64, 1000, 1 << 20):
        blocks = list(line_blocks(io.BytesIO(data), block_size))
        assert b"".join(b.tobytes() for b in blocks) == data
        assert all(b.tobytes().endswith(b"\n") for b in blocks[:-1])
        assert all(len(b) for b in blocks)
    assert list(line_blocks(io.BytesIO(b""), 16)) == []


def test_wrong_width_lines_are_named_with_their_text(criteo_sample, tmp_path):
    lines = (criteo_sample.head).read_text().splitlines()[:50]
    lines[7] = lines[7] + "\textra"
    lines[9] = ""
    path = tmp_path / "w.tsv"
    path.write_text("\n".join(lines) + "\n")
    got, ds = _read(path, 256, bad_lines="skip")
    assert len(got) == 48 and ds.bad_line_log.total == 2
    examples = ds.bad_line_log.examples
    assert any(e.startswith(f"{path}:8: expected 40 fields, found 41") for e in examples)
    assert any(e.startswith(f"{path}:10: expected 40 fields, found 0") for e in examples)


def test_parsed_values_match_the_reference_decoder(criteo_sample):
    path = criteo_sample.big
    fmt = CriteoFormat(block_size=1 << 15)
    blocks = [fmt.decode(b) for b in fmt.read(FileSlice(str(path)), on_invalid_row=lambda row: "skip")]
    labels, dense, ids = reference_rows(path)
    np.testing.assert_array_equal(np.concatenate([b.labels for b in blocks]), labels)
    np.testing.assert_allclose(np.concatenate([b.dense for b in blocks]), dense, rtol=1e-6)
    np.testing.assert_array_equal(np.concatenate([b.ids for b in blocks]), ids)
