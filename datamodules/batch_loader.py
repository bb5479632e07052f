"""The DataLoader that turns the workers' messages into Batches and keeps ranks in step."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.batch import Batch
from ctr_lightning.datamodules.stream_dataset import LogStreamDataset
from ctr_lightning.datamodules.wire import RawBatch, _Ones

log = logging.getLogger(__name__)


class BatchDataLoader(DataLoader):
    """A DataLoader over a :class:`LogStreamDataset` that yields :class:`~ctr_lightning.Batch` es.

    With ``process_group`` (a gloo process group over all ranks), every rank yields the same
    number of batches: before each batch the ranks agree that all of them still have one,
    and the first to run out ends the pass for everyone, so the last collective of an
    epoch never waits for a rank that has finished. The batches the other ranks hold back
    then are counted and logged, never dropped silently.

    With ``pad_ranks`` (validation, test and predict, where every example must be seen),
    the pass instead lasts until the last rank runs out, and a rank that ran out first
    yields empty batches meanwhile, so the collectives of a sharded model still meet.

    ``on_exhausted`` runs when a pass has handed out its last batch (Lightning asks for one
    more before it trains the last: the hook runs before that step).

    With ``require_examples`` (training), a pass that yields no batch at all is an
    :class:`EmptyEpochError` naming the files and why. ``epoch_of`` tells the dataset the
    epoch when a pass starts (its shards may rotate with it).

    Example::

        loader = BatchDataLoader(LogStreamDataset(["day_0.tsv"], CriteoFormat(), batch_size=4096),
                                 num_workers=2)
        for batch in loader: ...
    """

    def __init__(self, dataset: LogStreamDataset, process_group: Any = None, require_examples: bool = False,
                 epoch_of: Callable[[], int] | None = None, pad_ranks: bool = False,
                 on_exhausted: Callable[[], None] | None = None, **kwargs: Any) -> None:
        kwargs["batch_size"] = None  # the dataset yields whole batches, built in the workers
        super().__init__(dataset, **kwargs)
        self.process_group = process_group
        self.pad_ranks = pad_ranks
        self.padded = 0  # empty batches of the last pass, yielded while other ranks still read
        self.require_examples = require_examples
        self.epoch_of = epoch_of
        self.on_exhausted = on_exhausted
        self.shard_log: list[int] = []  # the shard of every batch handed out, in order
        self.held_back = (0, 0)  # (batches, examples) of the last pass not handed out to keep ranks even
        self.bad_line_counts: Counter[str] = Counter()  # lines skipped this pass, per file, all workers
        # Files cut short this pass (bad_files="skip") -> their first record not read (1-based):
        # the breaks their indexes found, and those the workers met.
        self.unreadable_files: dict[str, int] = {}
        self._ones = _Ones()

    def _batches(self) -> Iterator[tuple[int, Batch]]:
        keys = list(self.dataset.format.sparse_feature_names)
        warm_up = getattr(self.dataset.format, "warm_up", None)
        if warm_up is not None and self.num_workers > 0:
            warm_up()
        for raw in super().__iter__():
            raw = RawBatch(*raw)
            self.bad_line_counts.update(dict(raw.bad_lines))
            for path, record in raw.unreadable:
                self.unreadable_files[path] = min(record, self.unreadable_files.get(path, record))
            for batch in raw.to_batches(keys, self._ones):
                yield raw.shard, batch

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        self.shard_log = []
        self.held_back = (0, 0)
        self.bad_line_counts = Counter()
        self.unreadable_files = {f.path: f.first + f.records + 1 for f in self.dataset.files
                                 if f.unreadable is not None}
        if self.epoch_of is not None:
            self.dataset.epoch = self.epoch_of()  # before the workers start, with a copy of the dataset
        self.padded = 0
        batches = self._batches()
        while True:
            item = next(batches, None)
            if self.process_group is not None and self.pad_ranks:
                if not _ranks_agree(item is not None, self.process_group, torch.distributed.ReduceOp.MAX):
                    break
                if item is None:
                    self.padded += 1
                    yield self._empty_batch()
                    continue
            elif self.process_group is not None and not _ranks_agree(item is not None, self.process_group,
                                                                     torch.distributed.ReduceOp.MIN):
                if item is not None:
                    self._hold_back(item, batches)
                break
            if item is None:
                break
            self.shard_log.append(item[0])
            yield item[1]
        if self.require_examples and not self.shard_log:
            raise EmptyEpochError(f"epoch {self.dataset.epoch} of rank {self.dataset.rank} yielded no training "
                                  f"example: {self.dataset.describe_empty(self.bad_line_counts)}")
        if self.on_exhausted is not None:
            self.on_exhausted()

    def _empty_batch(self) -> Batch:
        fmt = self.dataset.format
        # With a group column every batch has groups, empty ones too: ranks then log the same metrics.
        groups = torch.zeros(0, dtype=torch.int64) if getattr(fmt, "group_column", None) is not None else None
        return Batch(dense=torch.zeros(0, fmt.num_dense_features),
                     sparse=KeyedJaggedTensor(keys=list(fmt.sparse_feature_names), values=torch.zeros(0, dtype=torch.int64),
                                              lengths=torch.zeros(0, dtype=torch.int32)),
                     labels=torch.zeros(0), records=torch.zeros(0, dtype=torch.int64), groups=groups)

    def _hold_back(self, item: tuple[int, Batch], rest: Iterator[tuple[int, Batch]]) -> None:
        count, examples = 1, len(item[1])
        for _, batch in rest:
            count, examples = count + 1, examples + len(batch)
        self.held_back = (count, examples)
        log.warning(
            "rank %d: another rank ran out of data first; %d batches (%d examples) of this epoch were not "
            "used, to keep every rank at the same step count", self.dataset.rank, count, examples)

    def expected_batches(self) -> int:
        """Batches a pass yields, from the files' record counts (a progress bar's total;
        fewer when lines are bad). Not ``__len__``: Lightning would stop the epoch there."""
        return self.dataset.expected_batches(largest_share=self.pad_ranks)

    def position(self, batches: int) -> dict[int, int]:
        """Batches per shard among the first ``batches`` handed out this pass."""
        counts: dict[int, int] = {}
        for shard in self.shard_log[:batches]:
            counts[shard] = counts.get(shard, 0) + 1
        return counts


class EmptyEpochError(ValueError):
    """A training pass over the data yielded nothing: the run would train on nothing."""


def _ranks_agree(have: bool, process_group: Any, op: Any) -> bool:
    """MIN: whether every rank has a batch; MAX: whether any has."""
    flag = torch.tensor([1 if have else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=op, group=process_group)
    return bool(flag.item())
