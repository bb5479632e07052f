import numpy as np
import pytest

from ctr_lightning.embedding.prefetch.staging import StagedChunk, StagedRows


def test_staged_rows_match_a_dictionary_over_many_puts_takes_and_releases():
    """Random chunks (rows staged again by later batches, stale tokens, empty chunks)
    against the rule they implement: per (table, id) the newest chunk not yet released
    serves its row if its token is still the SSD's."""
    rng = np.random.default_rng(0)
    width = 5
    staged = StagedRows()
    held: dict[int, dict[tuple[int, int], tuple[int, np.ndarray]]] = {}  # batch -> (table, id) -> (token, row)
    ssd_token: dict[tuple[int, int], int] = {}
    batch = released = 0
    for _ in range(300):
        if rng.random() < 0.5:  # a prefetch thread stages the next batch
            n = int(rng.integers(0, 60))
            keys = {(int(t), int(i)) for t, i in zip(rng.integers(0, 3, n), rng.integers(0, 200, n))}
            tables = np.array([k[0] for k in keys], dtype=np.int64)
            ids = np.array([k[1] for k in keys], dtype=np.int64)
            tokens = np.array([ssd_token.setdefault(k, 0) for k in keys], dtype=np.int64)
            rows = rng.standard_normal((len(keys), width)).astype(np.float32)
            locations = rng.integers(0, 10**6, len(keys))
            staged.put(StagedChunk(batch, tables, ids, tokens, locations, rows))
            held[batch] = {k: (int(tok), row, int(loc)) for k, tok, row, loc in zip(keys, tokens, rows, locations)}
            batch += 1
        if rng.random() < 0.2:  # a write-back makes some SSD copies newer
            for k in list(ssd_token)[: int(rng.integers(0, 10))]:
                ssd_token[k] += 1
        tables, ids = rng.integers(0, 3, 80), rng.integers(0, 200, 80)
        found, rows, locations, stale = staged.take(tables, ids, lambda t, i: np.array(
            [ssd_token.get((int(a), int(b)), 0) for a, b in zip(t, i)], dtype=np.int64))
        want_rows, want_locations, want_stale = [], [], 0
        for j, key in enumerate(zip(tables.tolist(), ids.tolist())):
            newest = next((held[b][key] for b in sorted(held, reverse=True) if key in held[b]), None)
            fresh = newest is not None and newest[0] == ssd_token[key]
            want_stale += newest is not None and not fresh
            assert found[j] == fresh
            if fresh:
                want_rows.append(newest[1])
                want_locations.append(newest[2])
        assert stale == want_stale and locations.tolist() == want_locations
        assert np.array_equal(rows.numpy().reshape(-1, width), np.array(want_rows).reshape(-1, width))
        if rng.random() < 0.4 and released < batch:  # a batch has run
            released += int(rng.integers(1, 3))
            staged.release(released - 1)
            held = {b: h for b, h in held.items() if b >= released}
        assert len(staged) == sum(len(h) for h in held.values())
    assert batch > 100 and released > 50


def test_chunks_out_of_batch_order_are_refused():
    staged = StagedRows()
    empty = np.empty(0, dtype=np.int64)
    staged.put(StagedChunk(5, empty, empty, empty, empty, np.empty((0, 3), dtype=np.float32)))
    staged.put(StagedChunk(4, empty, empty, empty, empty, np.empty((0, 3), dtype=np.float32)))
    with pytest.raises(RuntimeError, match="batch 4 arrived after batch 5"):
        staged.release(0)
