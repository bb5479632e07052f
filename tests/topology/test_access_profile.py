import numpy as np
import pytest

from ctr_lightning.topology import TableAccess, measure_access


def test_zipf_profile_matches_exact_sums():
    n, s = 200_000, 1.05
    p = np.arange(1, n + 1) ** -s
    p /= p.sum()
    access = TableAccess.zipf(n, s)
    assert access.num_ids == n
    for rows in (1, 500, 5_000, 50_000, n):
        assert access.coverage(rows) == pytest.approx(p[:rows].sum(), abs=2e-4)
    for lookups, skip in ((4096, 0), (50_000, 0), (50_000, 10_000)):
        assert access.unique(lookups, skip) == pytest.approx((-np.expm1(lookups * np.log1p(-p[skip:]))).sum(), rel=1e-3)
    assert access.rows_above(p[99]) == pytest.approx(100, abs=1)


def test_lru_misses_match_a_simulated_lru_cache():
    from collections import OrderedDict

    n, cache_rows, lookups = 20_000, 1_000, 256
    p = np.arange(1, n + 1) ** -1.0
    p /= p.sum()
    rng = np.random.default_rng(0)
    cache: OrderedDict = OrderedDict()
    misses = []
    for step in range(300):
        miss = 0
        for i in np.unique(rng.choice(n, size=lookups, p=p)):
            if i in cache:
                cache.move_to_end(i)
            else:
                miss += 1
                cache[i] = None
                if len(cache) > cache_rows:
                    cache.popitem(last=False)
        if step >= 100:
            misses.append(miss)
    access = TableAccess.zipf(n, 1.0)
    assert access.lru_misses(lookups, cache_rows) == pytest.approx(np.mean(misses), rel=0.05)
    assert access.lru_misses(lookups, cache_rows) > access.unique(lookups, cache_rows)  # worse than an ideal cache
    assert access.lru_misses(lookups, n) == 0.0


def test_sampled_profile_estimates_the_unseen_share():
    counts = np.array([50, 20, 10, 5, 1, 1, 1, 1])
    access = TableAccess.from_counts(counts, num_ids=1_000)
    assert access.num_ids == 1_000
    assert float((access.ids * access.probs).sum()) == pytest.approx(1.0)
    # Four of 89 lookups hit ids seen once: that is the chance of an id never seen.
    assert 1 - access.coverage(8) == pytest.approx(4 / 89)
    assert access.coverage(1) == pytest.approx(50 / 89 * (1 - 4 / 89))
    with pytest.raises(ValueError, match="no lookups"):
        TableAccess.from_counts(np.zeros(3), 10)


def test_measure_access_counts_a_datamodules_ids():
    from ctr_lightning.datamodules import SyntheticStreamDataModule

    dm = SyntheticStreamDataModule(num_sparse=3, batch_size=512, train_batches=4, val_batches=0,
                                   head_size=1_000, zipf_exponent=1.2, new_id_fraction=0.0, num_workers=0)
    dm.setup("fit")
    tables = {f"t_C{i}": [f"C{i}"] for i in (1, 2, 3)}
    access = measure_access(dm.train_dataloader(), tables, {t: 10_000 for t in tables}, max_batches=3)
    for a in access.values():
        assert a.pooling == 1.0 and a.num_ids == 10_000
        assert 0.3 < a.coverage(20) < 1.0  # a Zipf head: 20 of 1,000 ids serve a good share
    with pytest.raises(KeyError, match=r"table 't_X' reads feature 'X'"):
        measure_access(dm.train_dataloader(), {"t_X": ["X"]}, {"t_X": 10}, max_batches=1)
