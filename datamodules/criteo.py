"""The Criteo raw layout (Kaggle and 1TB "day_N" files): ``label, I1..I13, C1..C26``, and
Kaggle's unlabeled test.txt (``I1..I13, C1..C26``), scored, not trained on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from ctr_lightning.datamodules.criteo_parser import ParsedBlock, parse_block, warm_up
from ctr_lightning.datamodules.criteo_schema import DENSE_NAMES, NUM_FIELDS, SPARSE_NAMES
from ctr_lightning.datamodules.log_datamodule import LogDataModule
from ctr_lightning.datamodules.row_index import FileIndex
from ctr_lightning.datamodules.sources import FileSlice, line_blocks, read_head
from ctr_lightning.datamodules.log_format import DecodedRows


class CriteoFormat:
    """Reads the Criteo raw TSV layout and turns it into model-ready arrays.

    Counts become ``log(1 + max(x, 0))`` with missing as 0; each categorical value is
    hashed with its feature index to a 63-bit id (missing gets an id of its own).
    ``negative_counts="bad"`` makes a negative count a bad line instead of a 0. Lines
    are split and decoded in one compiled pass (:mod:`criteo_parser`).

    A file whose first lines have mostly 39 fields (no label, as Kaggle's ``test.txt``) is
    read as unlabeled: its labels are NaN, which predict scores and training refuses; its
    lines of another width (40 included) are bad lines, as 39-field lines are in a labeled
    file.

    Example::

        fmt = CriteoFormat()
        for block in fmt.read(FileSlice("day_0.tsv"), on_invalid_row=lambda r: "skip"):
            rows = fmt.decode(block)
    """

    num_fields = NUM_FIELDS  # of a labeled file; fields_of(path) is each file's
    delimiter = b"\t"
    line_based = True
    header_lines = 0
    sparse_feature_names = SPARSE_NAMES
    num_dense_features = len(DENSE_NAMES)

    def __init__(self, block_size: int = 1 << 19, negative_counts: str = "clamp") -> None:
        if negative_counts not in ("clamp", "bad"):
            raise ValueError(f"negative_counts must be 'clamp' or 'bad', got {negative_counts!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.negative_is_bad = negative_counts == "bad"
        count = "a non-negative integer" if self.negative_is_bad else "an integer"
        # Indexed by ParsedBlock.bad_field: the first invalid field of a line.
        self._reasons = (["label is not 0 or 1"] + [f"{name} is not {count}" for name in DENSE_NAMES]
                         + [f"{name} is not 8 hex digits" for name in SPARSE_NAMES])
        self._labeled: dict[str, bool] = {}  # each file's, from check_file
        self.unlabeled_reason: str | None = None  # why the file being read has no labels

    def check_file(self, index: FileIndex) -> None:
        """Note whether the file is labeled, from the whole lines of its head (when it is
        indexed): by their majority, so one damaged first line does not decide."""
        lines = index.head.split(b"\n")[:-1] or [index.head]  # a first line longer than the head: its start
        widths = [line.count(b"\t") + 1 for line in lines]
        self._labeled[index.path] = widths.count(NUM_FIELDS - 1) <= widths.count(NUM_FIELDS)

    def fields_of(self, path: str) -> int:
        return NUM_FIELDS if self._is_labeled(path) else NUM_FIELDS - 1

    def _is_labeled(self, path: str) -> bool:
        if path not in self._labeled:  # a file this format did not index (a FileSlice made by hand)
            self.check_file(FileIndex(path, 0, "text", head=read_head(path)))
        return self._labeled[path]

    def read(self, fslice: FileSlice, on_invalid_row: Callable[[object], str]) -> Iterator[ParsedBlock]:
        """Blocks of parsed lines; each wrong-width line goes to ``on_invalid_row`` (an
        object with the line's ``text``, as pyarrow's handler gets) before its block."""
        labeled = self._is_labeled(fslice.path)
        self.unlabeled_reason = None if labeled else (f"{NUM_FIELDS - 1} tab-separated fields a line, no label "
                                                      f"(as Kaggle's Criteo test.txt)")
        with fslice.open() as f:
            for data in line_blocks(f, self.block_size):
                for block, invalid in parse_block(data, self.negative_is_bad, labeled):
                    for text in invalid:
                        on_invalid_row(_InvalidRow(text.decode("utf-8", "replace")))
                    yield block

    def warm_up(self) -> None:
        warm_up()

    def decode(self, block: ParsedBlock) -> DecodedRows:
        problems = []
        bad = block.bad_field >= 0
        if bad.any():
            for field in np.unique(block.bad_field[bad]):
                problems.append((block.bad_field == field, self._reasons[field]))
        return DecodedRows(labels=block.labels, dense=block.dense, ids=block.ids, problems=problems)


class _InvalidRow(NamedTuple):
    text: str


class CriteoDataModule(LogDataModule):
    """Streams Criteo-layout logs (``.tsv``, ``.gz``, local or fsspec URLs). A file of 39
    fields a line, without the label (Kaggle's ``test.txt``), is scored as ``predict_paths``
    with empty labels; training on it is refused.

    Arguments as :class:`LogDataModule`, plus:

    Args:
        block_size: bytes parsed at a time.
        negative_counts: ``"clamp"`` (default) reads a negative count as 0, as the DLRM
            reference preprocessing does: Criteo's I2 holds small negative values in about
            one line of ten, so treating them as bad would drop real data. ``"bad"`` makes
            them bad lines, handled by the ``bad_lines`` policy.

    Example::

        dm = CriteoDataModule(train_paths=["day_0.gz"], val_paths=["day_1.gz"], batch_size=4096)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))   # ctr_lightning.Batch
    """

    def __init__(self, block_size: int = 1 << 19, negative_counts: str = "clamp", **kwargs: Any) -> None:
        super().__init__(CriteoFormat(block_size=block_size, negative_counts=negative_counts), **kwargs)
