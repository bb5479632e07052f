import numba
import numpy as np

from ctr_lightning.embedding.kernels.cache_hints import hint, hint_at, hint_span


@numba.njit
def _gather_sum(table, rows, ahead):
    total = 0.0
    for i in range(len(rows)):
        if i + ahead < len(rows):
            hint(table, rows[i + ahead])
        total += table[rows[i]]
    return total


@numba.njit
def _gather_rows(table, rows, ahead, out):
    for i in range(len(rows)):
        if i + ahead < len(rows):
            hint_at(table, rows[i + ahead], 0)
            hint_span(table, rows[i + ahead], 0, table.shape[1])
        out[i] = table[rows[i]]


def test_cache_hints_compile_and_leave_results_alone():
    rng = np.random.default_rng(0)
    flat = rng.integers(0, 1000, 50_000)
    rows = rng.integers(0, len(flat), 10_000)
    assert _gather_sum(flat, rows, 8) == flat[rows].sum()
    table = rng.standard_normal((5_000, 40)).astype(np.float32)  # rows that are not whole cache lines
    out = np.empty((len(rows) // 4, 40), dtype=np.float32)
    _gather_rows(table, rows[: len(out)] % len(table), 4, out)
    assert np.array_equal(out, table[rows[: len(out)] % len(table)])
