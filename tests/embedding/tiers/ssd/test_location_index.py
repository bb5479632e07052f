import numpy as np
import pytest

from ctr_lightning.embedding.tiers.ssd.location_index import LocationIndex


def test_matches_a_dict_when_writes_name_the_record_they_replace():
    rng = np.random.default_rng(0)
    index, truth, record = LocationIndex(), {}, 0
    for _ in range(200):
        tables, ids = rng.integers(0, 3, 500), rng.integers(0, 3000, 500)
        pairs = list(dict.fromkeys(zip(tables.tolist(), ids.tolist())))
        t, i = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
        old = np.array([truth.get(p, -1) for p in pairs])
        new = np.arange(record, record + len(pairs))
        record += len(pairs)
        index.put(t, i, old, new)
        truth.update(zip(pairs, new.tolist()))
        qt, qi = rng.integers(0, 3, 400), rng.integers(0, 3500, 400)
        got, _ = index.lookup(qt, qi)
        # Few keys here share a 32-bit hash: every first candidate is the key's own record.
        assert got.tolist() == [truth.get(k, -1) for k in zip(qt.tolist(), qi.tolist())]
    assert len(index) == len(truth)
    records = np.array(list(truth.values()))
    keys = np.array(list(truth.keys()))
    assert index.is_current(keys[:, 0], keys[:, 1], records).all()
    assert not index.is_current(keys[:, 0], keys[:, 1], records + 1).any()


def test_at_most_sixteen_bytes_an_entry_as_it_grows_and_no_write_rehashes_the_whole_index():
    index = LocationIndex()
    rng = np.random.default_rng(1)
    for start in range(0, 2_000_000, 20_000):
        ids = rng.integers(0, 2**62, 20_000)
        index.put(np.zeros(20_000, dtype=np.int64), ids, np.full(20_000, -1), np.arange(start, start + 20_000))
        assert index.nbytes / len(index) <= 16
        # Shards grow at their own loads, so growth is spread over the writes: each rehashes
        # a few times what it writes, where one index grown whole would rehash everything at once.
        assert index.most_rehashed <= 10 * 20_000 + 4 * len(index) / 256
    assert index.grow_us > 0 and index.most_rehashed > 0  # it did grow, shard by shard


def test_a_write_naming_a_record_the_index_lacks_is_refused():
    index = LocationIndex()
    index.put(np.array([0]), np.array([7]), np.array([-1]), np.array([3]))
    with pytest.raises(RuntimeError, match="no entry of table 0 id 7 at record 4"):
        index.put(np.array([0]), np.array([7]), np.array([4]), np.array([9]))
