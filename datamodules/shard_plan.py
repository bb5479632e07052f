"""Which records of which files each (rank, worker) reads in an epoch: equal shares, always.

The files' records form one sequence, in file order. Each rank gets an equal share of it
(within a record), in ``pieces_per_rank`` contiguous pieces; with ``rotate`` the pieces
are dealt to the ranks in an order that changes every epoch with the seed, as
``DistributedSampler.set_epoch`` reshuffles. Inside a rank, every worker but the last
reads a multiple of the batch size, so every rank cuts the same number of batches
(within one) whatever the files look like: one Parquet row group, a tiny and a huge file,
gzip files of any size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ctr_lightning.datamodules.row_index import FileIndex
from ctr_lightning.datamodules.sources import FileSlice

PIECES_PER_RANK = 4


def rank_intervals(total: int, rank: int, world_size: int, epoch: int = 0, seed: int = 0,
                   rotate: bool = False) -> list[tuple[int, int]]:
    """``[start, stop)`` intervals of the record sequence that ``rank`` reads, in order.

    Every rank reads ``total // world_size`` records or one more. The sequence is cut into
    ``pieces_per_rank`` pieces per rank; with ``rotate`` they are dealt out in a random
    order of the (seed, epoch), and each piece sized so that its rank's share stays exact.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    per_rank = PIECES_PER_RANK if rotate else 1
    pieces = world_size * per_rank
    order = np.arange(pieces)
    if rotate:
        order = np.random.default_rng([seed & 0xFFFFFFFF, epoch]).permutation(pieces)
    owner = np.empty(pieces, dtype=np.int64)
    owner[order] = np.repeat(np.arange(world_size), per_rank)  # rank r owns pieces order[r*k:(r+1)*k]
    quota = [total // world_size + (r < total % world_size) for r in range(world_size)]
    sizes = np.empty(pieces, dtype=np.int64)
    dealt = np.zeros(world_size, dtype=np.int64)
    for p in range(pieces):  # the j-th piece of rank r, in sequence order, holds its j-th share
        r, j = owner[p], dealt[owner[p]]
        sizes[p] = quota[r] * (j + 1) // per_rank - quota[r] * j // per_rank
        dealt[r] += 1
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [(int(bounds[p]), int(bounds[p + 1])) for p in range(pieces) if owner[p] == rank and sizes[p]]


def worker_intervals(intervals: Sequence[tuple[int, int]], worker: int, num_workers: int,
                     batch_size: int) -> list[tuple[int, int]]:
    """The part of a rank's intervals that ``worker`` reads: a multiple of ``batch_size``
    records for every worker but the last, so the rank cuts ``ceil(records / batch_size)``
    batches in all."""
    total = sum(b - a for a, b in intervals)
    share = -(-total // (batch_size * num_workers)) * batch_size
    lo, hi = min(worker * share, total), min((worker + 1) * share, total)
    out, seen = [], 0
    for a, b in intervals:
        start, stop = max(a, a + lo - seen), min(b, a + hi - seen)
        if stop > start:
            out.append((start, stop))
        seen += b - a
    return out


def file_slices(files: Sequence[FileIndex], intervals: Sequence[tuple[int, int]]) -> list[FileSlice]:
    """The intervals of the record sequence, cut at file boundaries."""
    starts = np.concatenate([[0], np.cumsum([f.records for f in files])]).astype(np.int64)
    out = []
    for a, b in intervals:
        for i in range(int(np.searchsorted(starts, a, side="right")) - 1, len(files)):
            if starts[i] >= b:
                break
            first, stop = max(a, starts[i]) - starts[i], min(b, starts[i + 1]) - starts[i]
            if stop > first:
                f = files[i]
                out.append(FileSlice(f.path, int(first) + f.first, int(stop) + f.first, f.header_lines, f.marks))
    return out


def plan_shard(files: Sequence[FileIndex], rank: int, world_size: int, worker: int, num_workers: int,
               batch_size: int, epoch: int = 0, seed: int = 0, rotate: bool = False) -> list[FileSlice]:
    """The slices (rank, worker) reads this epoch.

    Example::

        plan_shard(indexes, rank=1, world_size=4, worker=0, num_workers=2, batch_size=4096)
    """
    total = sum(f.records for f in files)
    mine = rank_intervals(total, rank, world_size, epoch, seed, rotate)
    return file_slices(files, worker_intervals(mine, worker, num_workers, batch_size))
