import numpy as np

from ctr_lightning.embedding.tiers.key_index import KeyIndex, dedup


def test_matches_a_dict_under_random_inserts_and_removes():
    rng = np.random.default_rng(0)
    index, ref = KeyIndex(capacity=16), {}
    for _ in range(300):
        keys = rng.integers(0, 3000, 200)
        tags = rng.integers(0, 3, 200)
        slots = rng.integers(0, 10**6, 200)
        index.insert(tags, keys, slots)
        ref.update(zip(zip(keys.tolist(), tags.tolist()), slots.tolist()))
        rk, rt = rng.integers(0, 3000, 80), rng.integers(0, 3, 80)
        index.remove(rt, rk)
        for k in zip(rk.tolist(), rt.tolist()):
            ref.pop(k, None)
        qk, qt = rng.integers(0, 3500, 400), rng.integers(0, 3, 400)
        want = [ref.get(k, -1) for k in zip(qk.tolist(), qt.tolist())]
        assert index.lookup(qt, qk).tolist() == want
        assert len(index) == len(ref)
    tags, keys, slots = index.items()
    assert dict(zip(zip(keys.tolist(), tags.tolist()), slots.tolist())) == ref


def test_full_64_bit_ids_do_not_collide_across_tables():
    ids = np.array([2**62 + 5, 2**62 + 5, 7], dtype=np.int64)
    index = KeyIndex()
    index.insert(np.array([0, 1, 0]), ids, np.array([10, 11, 12]))
    assert index.lookup(np.array([0, 1, 0]), ids).tolist() == [10, 11, 12]
    assert index.lookup(np.array([2, 2, 1]), ids).tolist() == [-1, -1, -1]


def test_lookup_unique_equals_dedup_then_lookup():
    # Sizes on both sides of the parallel threshold; hits, misses and repeats of each.
    rng = np.random.default_rng(1)
    for n in (0, 1, 50, 3000, 20000):
        index = KeyIndex()
        stored_keys, stored_tags = rng.integers(0, 5000, 4000), rng.integers(0, 3, 4000)
        index.insert(stored_tags, stored_keys, rng.permutation(100_000)[:4000])
        keys, tags = rng.integers(0, 8000, n), rng.integers(0, 3, n)
        mark = np.full(100_000, -1, dtype=np.int32)
        first, inverse, slots = index.lookup_unique(tags, keys, mark)
        want_first, want_inverse = dedup(tags, keys)
        assert first.tolist() == want_first.tolist()
        assert inverse.tolist() == want_inverse.tolist()
        assert slots.tolist() == index.lookup(tags[first], keys[first]).tolist()
        assert (mark == -1).all()  # the scratch is left as it was found


def test_dedup_agrees_with_numpy_unique():
    rng = np.random.default_rng(3)
    keys = rng.zipf(1.2, 5000).astype(np.int64) % 700
    tags = rng.integers(0, 3, 5000)
    first, inverse = dedup(tags, keys)
    pairs = np.stack([keys, tags], axis=1)
    unique, index, inv = np.unique(pairs, axis=0, return_index=True, return_inverse=True)
    # Same set of pairs; each listed once, at its first occurrence, in order of appearance.
    assert len(first) == len(unique)
    assert np.array_equal(np.sort(first), np.sort(index))
    assert np.all(np.diff(first) > 0)
    assert np.array_equal(pairs[first][inverse], pairs)
    # Equal pairs share an inverse, different pairs do not (as numpy's inverse says).
    assert np.array_equal(unique[inv.reshape(-1)], pairs)
    remap = np.empty(len(unique), dtype=np.int64)
    remap[inv.reshape(-1)] = inverse
    assert np.array_equal(remap[inv.reshape(-1)], inverse)
    empty_first, empty_inverse = dedup(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    assert len(empty_first) == len(empty_inverse) == 0
