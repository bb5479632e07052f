
import numpy as np



def test_ssd_log_compacts_and_keeps_the_latest_rows(tmp_path):
    from ctr_lightning.embedding.ssd import SsdStore

    store = SsdStore(tmp_path, "g", width=4, table_names=["a", "b"], garbage_bytes=16 * 1000)
    rng = np.random.default_rng(0)
    latest = {}
    for step in range(200):
        ids = rng.choice(3000, size=500, replace=False)
        tables = rng.integers(0, 2, 500)
        keep = np.unique(np.stack([ids, tables], 1), axis=0, return_index=True)[1]
        ids, tables = ids[keep], tables[keep]
        rows = rng.random((len(ids), 4), dtype=np.float32) + step
        store.write(tables, ids, rows)
        latest.update({(int(t), int(i)): r for t, i, r in zip(tables, ids, rows)})
    assert store.records < 200 * 500  # the log was compacted on the way
    keys = list(latest)
    found, rows, _ = store.read(np.array([k[0] for k in keys]), np.array([k[1] for k in keys]))
    assert found.all() and len(store) == len(keys)
    np.testing.assert_array_equal(rows, np.stack([latest[k] for k in keys]))
    assert store.records <= 2 * len(keys) + 1000 + 500
