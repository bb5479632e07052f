"""What a log format is: how it reads a file slice, and the model-ready rows it decodes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ctr_lightning.datamodules.row_index import HeaderLines
from ctr_lightning.datamodules.sources import FileSlice


@dataclass
class JaggedIds:
    """A multi-hot feature of n rows: ``lengths[i]`` ids of row i, all in ``values``."""

    lengths: np.ndarray  # [n] int32
    values: np.ndarray  # [lengths.sum()] int64

    def _offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    def slice(self, start: int, stop: int) -> JaggedIds:
        offsets = self._offsets()
        return JaggedIds(self.lengths[start:stop], self.values[offsets[start] : offsets[stop]])

    def select(self, keep: np.ndarray) -> JaggedIds:
        return JaggedIds(self.lengths[keep], self.values[np.repeat(keep, self.lengths)])

    @staticmethod
    def concat(parts: list[JaggedIds]) -> JaggedIds:
        return JaggedIds(np.concatenate([p.lengths for p in parts]), np.concatenate([p.values for p in parts]))


@dataclass
class DecodedRows:
    """Model-ready arrays for one record batch, with the rows that failed validation.

    ``problems`` pairs a row mask with the reason; a row is bad if any mask holds it.
    """

    labels: np.ndarray  # [n] float32
    dense: np.ndarray  # [n, num_dense] float32
    ids: np.ndarray  # [n, num_one_hot] int64, one id per one-hot categorical feature
    problems: list[tuple[np.ndarray, str]]
    jagged: tuple[JaggedIds, ...] = ()  # multi-hot features, after the one-hot ones
    groups: np.ndarray | None = None  # [n] int64: the grouping column (user, query) for GAUC
    records: np.ndarray | None = None  # [n] int64: each row's place in its split's records (predict)
    event_time: np.ndarray | None = None  # [n] int64 POSIX seconds (Batch.event_time)

    def __len__(self) -> int:
        return len(self.labels)

    def slice(self, start: int, stop: int) -> DecodedRows:
        return DecodedRows(self.labels[start:stop], self.dense[start:stop], self.ids[start:stop], [],
                           tuple(j.slice(start, stop) for j in self.jagged),
                           _part(self.groups, slice(start, stop)), _part(self.records, slice(start, stop)),
                           _part(self.event_time, slice(start, stop)))

    def select(self, keep: np.ndarray) -> DecodedRows:
        return DecodedRows(self.labels[keep], self.dense[keep], self.ids[keep], [],
                           tuple(j.select(keep) for j in self.jagged), _part(self.groups, keep),
                           _part(self.records, keep), _part(self.event_time, keep))

    @staticmethod
    def concat(parts: list[DecodedRows]) -> DecodedRows:
        return DecodedRows(
            np.concatenate([p.labels for p in parts]),
            np.concatenate([p.dense for p in parts]),
            np.concatenate([p.ids for p in parts]),
            [],
            tuple(JaggedIds.concat([p.jagged[k] for p in parts]) for k in range(len(parts[0].jagged))),
            None if parts[0].groups is None else np.concatenate([p.groups for p in parts]),
            None if parts[0].records is None else np.concatenate([p.records for p in parts]),
            None if parts[0].event_time is None else np.concatenate([p.event_time for p in parts]),
        )


def _part(column: np.ndarray | None, index: slice | np.ndarray) -> np.ndarray | None:
    return None if column is None else column[index]


class LogFormat(Protocol):
    """How one ad-log format is read and turned into arrays."""

    line_based: bool  # records are lines: byte-range shards, errors named by file:line
    num_fields: int
    delimiter: bytes
    header_lines: HeaderLines  # lines at the top of each file that are not records (or a rule per file)
    sparse_feature_names: tuple[str, ...]
    num_dense_features: int

    def read(self, fslice: FileSlice, on_invalid_row: Callable[[Any], str]) -> Iterator[Any]:
        """Blocks of parsed records of ``fslice``; each row of the wrong width goes to
        ``on_invalid_row`` (an object with the line's ``text``) before its block."""

    def decode(self, block: Any) -> DecodedRows:
        """Model-ready arrays of one block, with the rows that failed validation."""

    # Optional: ``warm_up()`` loads compiled code in the main process before workers fork;
    # ``check_file(index)`` sees each file's index (its head) before any reading, to refuse
    # it or note its layout; ``unlabeled_reason``, set by ``read``, says why the file being
    # read has no labels (NaN), which only predict accepts. For line-based formats whose
    # width is not ``num_fields`` split at ``delimiter``: ``count_fields(line) -> int``
    # (quoted fields) and ``fields_of(path) -> int`` (a width per file: from its header, or
    # Criteo with or without its label), to find and name the lines of the wrong width.
