import numpy as np

from ctr_lightning.embedding.initializer import initial_rows, initialize_slots, table_key


def test_rows_written_in_place_equal_the_initial_rows_with_zero_state():
    rng = np.random.default_rng(0)
    tables = np.array([table_key(n) for n in ("a", "b", "a", "c")], dtype=np.int64)
    ids = np.array([5, 5, 10**15, 0], dtype=np.int64)
    bounds = np.array([0.1, 0.2, 0.1, 0.3])
    storage = rng.standard_normal((10, 8 + 16)).astype(np.float32)  # dim 8 + Adam state
    before = storage.copy()
    slots = np.array([7, 2, 9, 0])
    initialize_slots(3, tables, ids, 8, bounds, storage, slots)
    assert np.array_equal(storage[slots, :8], initial_rows(3, tables, ids, 8, bounds))
    assert not storage[slots, 8:].any()
    untouched = np.setdiff1d(np.arange(10), slots)
    assert np.array_equal(storage[untouched], before[untouched])
    # Same (seed, table, id), same row; another table or seed, another row.
    assert not np.array_equal(storage[7, :8], storage[2, :8])
    assert not np.array_equal(initial_rows(4, tables[:1], ids[:1], 8, bounds[:1]), storage[7:8, :8])
