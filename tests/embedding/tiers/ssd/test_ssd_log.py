import numba
import numpy as np
import pytest

from ctr_lightning.embedding.tiers.ssd.directory_lock import LOCK_FILE
from ctr_lightning.embedding.tiers.ssd.location_index import key_hash
from ctr_lightning.embedding.tiers.ssd.ssd_log import KEY, SsdLog


def write_tracked(log, where, tables, ids, rows):
    """Write as the tiers do: naming each row's current record, and following relocations."""
    old = np.array([where.get((int(t), int(i)), -1) for t, i in zip(tables, ids)], dtype=np.int64)
    locations, moved = log.write(tables, ids, rows, old)
    where.update({(int(t), int(i)): int(r) for t, i, r in zip(tables, ids, locations)})
    where.update({(int(t), int(i)): int(r) for t, i, r in zip(moved.tables, moved.ids, moved.locations)})


def test_cleaning_keeps_the_latest_rows_and_the_files_near_the_live_bytes(tmp_path):
    log = SsdLog(tmp_path, "g", width=4, table_names=["a", "b"], segment_bytes=32 * 500, max_garbage=0.3)
    rng = np.random.default_rng(0)
    latest, where = {}, {}
    for step in range(300):
        ids = rng.choice(3000, size=500, replace=False)
        tables = rng.integers(0, 2, 500)
        keep = np.unique(np.stack([ids, tables], 1), axis=0, return_index=True)[1]
        ids, tables = ids[keep], tables[keep]
        rows = rng.random((len(ids), 4), dtype=np.float32) + step
        write_tracked(log, where, tables, ids, rows)
        latest.update({(int(t), int(i)): r for t, i, r in zip(tables, ids, rows)})
        # Garbage over 30% of the live records is cleaned away, a few segments at most behind.
        # (with each record's key in the keys file beside its segment)
        on_disk = log.record_bytes + KEY.itemsize
        assert log.disk_bytes <= 1.3 * len(log) * on_disk + 3 * log.segment_records * on_disk
    assert log.segments_cleaned > 50 and log.records_moved > 0
    keys = list(latest)
    found, rows, locations = log.read(np.array([k[0] for k in keys]), np.array([k[1] for k in keys]))
    assert found.all() and len(log) == len(keys)
    np.testing.assert_array_equal(rows, np.stack([latest[k] for k in keys]))
    assert locations.tolist() == [where[k] for k in keys]
    files = sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_FILE)
    assert len(files) == 2 * len([s for s in log.segments.values() if not s.retired])  # segment and keys file
    chunks = list(log.entries(chunk_records=100))
    assert sum(len(c[1]) for c in chunks) == len(keys)


@numba.njit
def _hashes(tables, ids, out):
    for i in range(len(ids)):
        out[i] = key_hash(tables[i], ids[i])


def test_keys_that_share_an_index_hash_are_told_apart_by_their_records(tmp_path):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 2**62, 400_000)
    hashes = np.empty(len(ids), dtype=np.uint64)
    _hashes(np.zeros(len(ids), dtype=np.int64), ids, hashes)
    order = np.argsort(hashes)
    same = np.flatnonzero(np.diff(hashes[order]) == 0)
    assert len(same) >= 2, "no two keys share a 32-bit hash"
    pairs = [(ids[order[k]], ids[order[k + 1]]) for k in same[:2]]
    log = SsdLog(tmp_path, "g", width=2, table_names=["t"])
    (a, b), (c, d) = pairs
    zeros = np.zeros(2, dtype=np.int64)
    log.write(zeros, np.array([a, b]), np.array([[1, 1], [2, 2]], dtype=np.float32), np.full(2, -1))
    log.write(zeros[:1], np.array([c]), np.array([[3, 3]], dtype=np.float32), np.full(1, -1))
    found, rows, _ = log.read(np.zeros(4, dtype=np.int64), np.array([b, a, c, d]))
    assert found.tolist() == [True, True, True, False]  # d shares c's hash but was never stored
    assert rows.tolist() == [[2, 2], [1, 1], [3, 3]]
    # A rewrite names the record it replaces, so the other key's entry stays untouched.
    _, _, (loc_a, loc_b) = log.read(zeros, np.array([a, b]))
    log.write(zeros[:1], np.array([b]), np.array([[5, 5]], dtype=np.float32), np.array([loc_b]))
    found, rows, _ = log.read(zeros, np.array([a, b]))
    assert rows.tolist() == [[1, 1], [5, 5]] and len(log) == 3


def test_a_prefetch_reads_pinned_segments_while_cleaning_deletes_them(tmp_path):
    log = SsdLog(tmp_path, "g", width=2, table_names=["t"], segment_bytes=24 * 10, max_garbage=0.0)
    where = {}
    ids = np.arange(30)
    write_tracked(log, where, np.zeros(30, dtype=np.int64), ids, np.ones((30, 2), dtype=np.float32))
    locations, tokens, pinned = log.locate(np.zeros(30, dtype=np.int64), ids)
    for step in range(5):  # rewrites make the first segments garbage: they are cleaned and deleted
        write_tracked(log, where, np.zeros(30, dtype=np.int64), ids, np.full((30, 2), step + 2, dtype=np.float32))
    assert log.segments_cleaned > 0
    ok, rows = log.read_located(np.zeros(30, dtype=np.int64), ids, locations, pinned)
    assert ok.all() and (rows == 1).all()  # the pinned descriptors still read the old copies
    assert (log.tokens(np.zeros(30, dtype=np.int64), ids) != tokens).all()  # which are stale now
    log.release(pinned)
    assert all(not s.retired for s in log.segments.values())


def test_a_full_disk_names_the_directory_and_keeps_what_was_written(tmp_path):
    import resource

    log = SsdLog(tmp_path, "g", width=64, table_names=["t"])
    log.write(np.zeros(10, dtype=np.int64), np.arange(10), np.ones((10, 64), dtype=np.float32), np.full(10, -1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    import signal

    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        with pytest.raises(OSError, match=rf"SSD tier of tables \['t'\]: writing {tmp_path}.*failed"):
            log.write(np.zeros(100, dtype=np.int64), np.arange(10, 110), np.ones((100, 64), dtype=np.float32),
                      np.full(100, -1))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    found, rows, _ = log.read(np.zeros(10, dtype=np.int64), np.arange(10))
    assert found.all() and (rows == 1).all() and len(log) == 10
