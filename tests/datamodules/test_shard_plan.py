import itertools

import numpy as np
import pytest

from ctr_lightning.datamodules.row_index import FileIndex
from ctr_lightning.datamodules.shard_plan import plan_shard, rank_intervals

FILES = [FileIndex("a", 3, "text"), FileIndex("b", 10_000, "text"), FileIndex("c", 0, "text"),
         FileIndex("d", 517, "compressed")]


@pytest.mark.parametrize("rotate", [False, True])
def test_every_record_once_and_equal_batches_per_rank(rotate):
    total = sum(f.records for f in FILES)
    for world, workers, batch, epoch in itertools.product([1, 2, 3, 4, 7], [1, 2, 3], [1, 7, 64, 4096], [0, 3]):
        seen, batches = [], []
        for rank in range(world):
            per_rank = 0
            for worker in range(workers):
                pieces = plan_shard(FILES, rank, world, worker, workers, batch, epoch, seed=5, rotate=rotate)
                records = sum(p.stop - p.first for p in pieces)
                per_rank += -(-records // batch)
                seen += [(p.path, i) for p in pieces for i in range(p.first, p.stop)]
            batches.append(per_rank)
        assert len(seen) == len(set(seen)) == total, (world, workers, batch)
        assert max(batches) - min(batches) <= 1, (world, workers, batch, batches)


def test_rotation_deals_other_pieces_each_epoch_and_repeats_for_a_seed():
    plans = {epoch: rank_intervals(10_000, 0, 2, epoch, seed=1, rotate=True) for epoch in range(4)}
    assert len({tuple(p) for p in plans.values()}) > 1
    assert rank_intervals(10_000, 0, 2, 2, seed=1, rotate=True) == plans[2]
    assert rank_intervals(10_000, 0, 2, 2, seed=2, rotate=True) != plans[2]
    assert rank_intervals(10_000, 0, 2, 2, seed=1, rotate=False) == [(0, 5_000)]
    for epoch in range(4):  # always half the records each
        for rank in range(2):
            assert sum(b - a for a, b in rank_intervals(10_001, rank, 2, epoch, 1, True)) in (5_000, 5_001)


def test_bad_rank():
    with pytest.raises(ValueError, match="rank 2 outside"):
        rank_intervals(10, 2, 2)
    assert np.all([plan_shard(FILES, 0, 1, 0, 1, 8)[0].path == "a"])
