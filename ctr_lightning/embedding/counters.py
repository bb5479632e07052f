"""Counters of several table groups, collections or ranks, added up key by key."""

from __future__ import annotations

from collections.abc import Iterable


def sum_counters(counters: Iterable[dict[str, int]]) -> dict[str, int]:
    """Key-wise sum; a key missing from some counts as 0.

    Example::

        sum_counters(c.tier_stats() for c in collections)
    """
    total: dict[str, int] = {}
    for counts in counters:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    return total
