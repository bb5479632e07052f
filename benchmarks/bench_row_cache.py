"""Choosing a memory tier's victims, fused (``RowCache.choose_victims`` now: one numba pass
counts and one gathers each table's candidates with their keys) against the anchor, the same
choice in separate NumPy array operations (the code before 2026-12-05, kept below), in ONE
run on the same cache.

The cache is the out-of-core run's DRAM tier (bench_out_of_core.py: 26 tables of dim 64 with
Adam rows, 80 MB a table, so about 104k slots each, 2.7M in all), full, half the tables LRU
and half LFU, with random recency and use counts and 20k pinned slots. Both choices must pick
the same keys (ties may go to other slots). Prints, for the choice every table needs room in
and the one only one table needs room in, the median milliseconds of each and their ratio.

    python benchmarks/bench_row_cache.py [--rows-per-table 104000 --repeats 9]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
import torch

from ctr_lightning.embedding.tiers.row_cache import RowCache, Rows


@numba.njit(cache=True, nogil=True)
def group_by_table(tables, num_tables):
    """The anchor's counting sort (row_cache._group_by_table before 2026-12-05)."""
    starts = np.zeros(num_tables + 1, dtype=np.int64)
    for t in tables:
        starts[t + 1] += 1
    for t in range(num_tables):
        starts[t + 1] += starts[t]
    fill = starts[:-1].copy()
    order = np.empty(len(tables), dtype=np.int64)
    for i in range(len(tables)):
        order[fill[tables[i]]] = i
        fill[tables[i]] += 1
    return order, starts


def separate_operations(cache: RowCache, need: np.ndarray, pinned: np.ndarray) -> np.ndarray:
    """The anchor: ``choose_victims``' slots as chosen before 2026-12-05 (about ten array
    passes over every slot, then a counting sort)."""
    wanted = np.where(need > 0, need + cache.capacity // 32, 0)
    slot_table = cache.slot_table
    candidate = slot_table >= 0
    candidate[pinned[pinned < len(slot_table)]] = False
    candidate &= need[np.maximum(slot_table, 0)] > 0
    slots = np.flatnonzero(candidate)
    tables = slot_table[slots]
    available = np.bincount(tables, minlength=len(need))
    recency = cache.last_used[slots]
    key = np.where(cache.lfu[tables], (cache.uses[slots] << 32) | (recency & 0xFFFFFFFF), recency)
    order, starts = group_by_table(tables, len(need))
    take = np.minimum(wanted, available)
    victims = []
    for t in np.flatnonzero(take):
        members = order[starts[t] : starts[t + 1]]
        if take[t] < len(members):
            members = members[np.argpartition(key[members], take[t] - 1)[: take[t]]]
        victims.append(slots[members])
    return np.sort(np.concatenate(victims)) if victims else np.empty(0, dtype=np.int64)


def eviction_keys(cache: RowCache, slots: np.ndarray) -> np.ndarray:
    tables = cache.table_code[slots].astype(np.int64) - 1
    return np.where(cache.lfu[tables], (cache.uses[slots] << 32) | cache.last_used[slots], cache.last_used[slots])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows-per-table", type=int, default=104_000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    n, rows = args.tables, args.rows_per_table
    cache = RowCache(width=4, capacities=[rows] * n, lfu=[t % 2 == 1 for t in range(n)], device="cpu")
    for t in range(n):
        cache.insert(Rows(np.full(rows, t, dtype=np.int64), np.arange(rows, dtype=np.int64), torch.zeros(rows, 4),
                          np.zeros(rows, dtype=bool)))
    rng = np.random.default_rng(0)
    cache.last_used[: cache.never_used] = rng.integers(0, 50_000, cache.never_used)
    cache.uses[: cache.never_used] = rng.integers(0, 8, cache.never_used)
    pinned = rng.choice(cache.never_used, 20_000, replace=False).astype(np.int64)
    names = [f"t{t}" for t in range(n)]
    print(f"{n} tables x {rows:,} slots, full; medians of {args.repeats}")
    print(f"{'room needed in':<16}{'separate ops ms':>17}{'fused ms':>10}{'ratio':>8}")
    for label, need in (("every table", np.full(n, 500, dtype=np.int64)),
                        ("one table", np.where(np.arange(n) == 3, 500, 0).astype(np.int64))):
        ours, _ = cache.choose_victims(need, pinned, names)
        anchor = separate_operations(cache, need, pinned)
        for t in range(n):  # the same choice, up to ties
            a, b = anchor[cache.table_code[anchor] == t + 1], ours[cache.table_code[ours] == t + 1]
            if not np.array_equal(np.sort(eviction_keys(cache, a)), np.sort(eviction_keys(cache, b))):
                raise AssertionError(f"table {t}: the fused choice differs from the anchor's")
        times = {"anchor": [], "fused": []}
        for _ in range(args.repeats):  # alternating, so drift on shared cores hits both alike
            start = time.perf_counter()
            separate_operations(cache, need, pinned)
            times["anchor"].append(time.perf_counter() - start)
            start = time.perf_counter()
            cache.choose_victims(need, pinned, names)
            times["fused"].append(time.perf_counter() - start)
        anchor_ms, fused_ms = (1000 * float(np.median(times[k])) for k in ("anchor", "fused"))
        print(f"{label:<16}{anchor_ms:>17.1f}{fused_ms:>10.1f}{anchor_ms / fused_ms:>7.2f}x")


if __name__ == "__main__":
    main()
