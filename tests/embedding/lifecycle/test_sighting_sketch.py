import numpy as np
import pytest
import torch

from ctr_lightning.embedding.lifecycle.sighting_sketch import PARTITIONS, SightingSketch, min_sketch_bytes
from ctr_lightning.embedding.sharding_plan import row_owner


def test_each_owner_counts_exactly_what_one_process_counts_collisions_included():
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(0, 1 << 62, 1_500_000))
    occurrences = rng.integers(1, 3, len(ids))
    one = SightingSketch("t", min_sketch_bytes(), seed=1)
    whole = one.add(ids, occurrences)
    assert (whole > occurrences).sum() > 1000  # a small sketch: collisions happen, and overestimate only
    assert (whole >= occurrences).all()
    for world in (2, 3, 8):
        owner = row_owner(torch.from_numpy(ids), world).numpy()
        shards = [SightingSketch("t", min_sketch_bytes(), seed=1, world=world, rank=r) for r in range(world)]
        got = np.empty_like(whole)
        # Each owner sees its ids, in another order: the counts do not depend on it.
        for r, shard in enumerate(shards):
            mine = np.flatnonzero(owner == r)[::-1]
            got[mine] = shard.add(ids[mine], occurrences[mine])
        np.testing.assert_array_equal(got, whole)
        joined = np.maximum.reduce([s.state() for s in shards])
        np.testing.assert_array_equal(joined, one.state())
        # Loaded into another world size, each rank continues with its partitions.
        again = SightingSketch("t", min_sketch_bytes(), seed=1, world=2, rank=1)
        again.load(joined)
        np.testing.assert_array_equal(again.counts, one.counts[1::2])


def test_counts_saturate_and_other_seeds_or_tables_hash_elsewhere():
    sketch = SightingSketch("t", min_sketch_bytes(), seed=0)
    ids = np.arange(10, dtype=np.int64)
    assert sketch.add(ids, np.full(10, 200)).tolist() == [200] * 10
    assert sketch.add(ids, np.full(10, 200)).tolist() == [255] * 10
    a, b = SightingSketch("t", min_sketch_bytes(), seed=0), SightingSketch("u", min_sketch_bytes(), seed=0)
    a.add(ids, np.ones(10, dtype=np.int64))
    b.add(ids, np.ones(10, dtype=np.int64))
    assert not np.array_equal(a.counts, b.counts)


def test_world_sizes_that_do_not_divide_the_partitions_are_refused_naming_the_table():
    assert PARTITIONS % 11
    with pytest.raises(ValueError, match="table 'user'.*11 ranks do not divide"):
        SightingSketch("user", min_sketch_bytes(), seed=0, world=11, rank=0)
    with pytest.raises(ValueError, match="shape"):
        SightingSketch("user", min_sketch_bytes(), seed=0).load(np.zeros((3, 2, 8), dtype=np.uint8))
