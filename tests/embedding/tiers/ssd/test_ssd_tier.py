import inspect

import numpy as np
import pytest

from ctr_lightning.embedding.tiers.ssd.direct_store import DirectSsdStore
from ctr_lightning.embedding.tiers.ssd.ssd_log import SsdLog
from ctr_lightning.embedding.tiers.ssd.ssd_tier import NO_SSD_COUNTERS, SsdTier

WIDTH = 4


def make(kind, directory):
    if kind == "log":  # 10 records a segment: 30 rows fill and seal three
        return SsdLog(directory, "g", width=WIDTH, table_names=["a", "b"], segment_bytes=(4 + WIDTH) * 4 * 10)
    return DirectSsdStore(directory, "g", width=WIDTH, table_names=["a", "b"], num_embeddings=[100, 100])


def rows_of(chunks):
    return {(int(t), int(i)): r.tolist() for tables, ids, rows in chunks for t, i, r in zip(tables, ids, rows)}


@pytest.mark.parametrize("kind", ["log", "direct"])
def test_both_stores_are_ssd_tiers_with_the_protocols_signatures(tmp_path, kind):
    store = make(kind, tmp_path)
    assert isinstance(store, SsdTier)
    for name, member in vars(SsdTier).items():
        if inspect.isfunction(member) and not name.startswith("_"):
            assert (list(inspect.signature(getattr(type(store), name)).parameters)
                    == list(inspect.signature(member).parameters)), name
    assert set(store.counters()) == set(NO_SSD_COUNTERS)
    store.close()


@pytest.mark.parametrize("kind", ["log", "direct"])
def test_each_capability_answers_on_both_stores(tmp_path, kind):
    store = make(kind, tmp_path / "ssd")
    tables, ids = np.repeat([0, 1], 15), np.tile(np.arange(15), 2)
    rows = np.arange(30 * WIDTH, dtype=np.float32).reshape(30, WIDTH)
    store.write(tables, ids, rows, np.full(30, -1))
    assert store.shares_segments == (kind == "log")
    assert store.may_hold(np.array([0, 1, 0]), np.array([3, 14, 50])).tolist() == [True, True, False]
    expected = rows_of([(tables, ids, rows)])
    sealed = list(store.sealed())
    # The rows lie in sealed segments (the log's full ones) or are active entries: together, all of them.
    in_sealed = rows_of(chunk for s in sealed for chunk in store.segment_entries(s.number))
    active = rows_of(store.active_entries())
    assert {**in_sealed, **active} == expected == rows_of(store.entries())
    assert (len(sealed) > 0) == store.shares_segments
    assert store.can_adopt(store.record_bytes, 1) == store.shares_segments
    if not store.shares_segments:
        assert not store.adopt(tmp_path / "x.seg", tmp_path / "x.keys", 1, 0, np.empty(0), np.ones(1, dtype=bool))
        with pytest.raises(KeyError, match="no segment 0"):
            store.segment_entries(0)
    # Since a mark: the rows written after it (a superset), sealed or active.
    mark = store.mark()
    store.write(np.array([1]), np.array([3]), np.full((1, WIDTH), -1, dtype=np.float32),
                store.read(np.array([1]), np.array([3]))[2])
    since = rows_of(store.entries_since(mark))
    assert since[(1, 3)] == [-1.0] * WIDTH
    later = rows_of(chunk for s in store.sealed(mark) for chunk in store.segment_entries(s.number))
    assert {**later, **rows_of(store.active_entries(mark))}[(1, 3)] == [-1.0] * WIDTH
    store.clear()
    assert len(store) == 0 and not store.may_hold(np.array([0]), np.array([3]))[0]
    store.close()
