"""Row caps (``Expiry.max_rows``) of tables sharded row-wise: the floor over every rank's rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ctr_lightning.embedding.table_group import TableGroup

# Steps of counts an all-reduce carries per table while the floor is searched: in a steady
# state the floor rises a step or two per training step, so one round finds it.
_CHUNK_STEPS = 64


class SharedRowCaps:
    """Raises the floors of row-wise sharded tables that have ``max_rows`` to where one
    process holding every row would raise them: the oldest step whose rows, with all newer
    ones, fit the cap, counted over every rank's shard.

    Each rank's :class:`RowExpiry` counts its shard's live rows per last-lookup step and
    raises the ttl part of the floor after each step; the cap's part waits for
    :meth:`settle`, which every rank calls at the same points (before a forward, a read or a
    save: all collective already), so it costs one all-reduce of a number per capped table,
    and one of a few steps' counts when the cap is exceeded. The floors every rank reaches
    are the same, so each rank evicts its own share of exactly the rows one process evicts.

    Example::

        caps = SharedRowCaps(local.groups, process_group)
        caps.settle()   # collective; then look rows up
    """

    def __init__(self, groups: Sequence[TableGroup], process_group: dist.ProcessGroup) -> None:
        capped = [(group.names[t], group, int(t)) for group in groups if group.expiry is not None
                  for t in np.flatnonzero(group.expiry.shared_cap)]
        # The same order on every rank (every rank holds a shard of each row-wise table).
        self.tables = sorted(capped, key=lambda entry: entry[0])
        self.process_group = process_group

    def settle(self, clocks: Mapping[str, int] | None = None) -> None:
        """Collective: raise each capped table's floor over every rank's live rows;
        ``clocks``: the tables' training step counts where their groups do not count them
        (k-step owners)."""
        if not self.tables:
            return

        def clock(i: int) -> int:
            name, group, t = self.tables[i]
            return int(clocks[name]) if clocks is not None else int(group.steps[t])

        for _, group, _ in self.tables:
            group.recount_if_loaded()
        n = len(self.tables)
        # With each table's live rows, whether any rank loaded rows saved without expiry (RowExpiry.widen).
        totals = torch.tensor([group.expiry.live_total(t) for _, group, t in self.tables]
                              + [int(group.expiry.widened_cap[t]) for _, group, t in self.tables], dtype=torch.int64)
        dist.all_reduce(totals, group=self.process_group)
        for i, (_, group, t) in enumerate(self.tables):
            if totals[n + i] > 0:  # refused on every rank alike, before any of those rows go
                group.expiry.widened_cap[t] = True
                group.expiry.check_widened(t, int(totals[i]))
        totals = totals[:n]
        excess = {i: int(totals[i]) - int(group.expiry.max_rows[t])
                  for i, (_, group, t) in enumerate(self.tables) if int(totals[i]) > int(group.expiry.max_rows[t])}
        start = {i: int(self.tables[i][1].expiry.floor[self.tables[i][2]]) for i in excess}
        top: dict[int, int] = {}
        scored = [i for i in sorted(excess) if self.tables[i][1].expiry.scored[self.tables[i][2]]]
        if scored:
            # Score buckets start wherever the lowest score lies: search from the lowest
            # counted on any rank, up to the highest.
            spans = torch.tensor([self.tables[i][1].expiry.key_span(self.tables[i][2]) for i in scored],
                                 dtype=torch.int64)
            spans[:, 0] = -spans[:, 0]
            dist.all_reduce(spans, op=dist.ReduceOp.MAX, group=self.process_group)
            for i, (low, high) in zip(scored, spans.tolist()):
                start[i], top[i] = max(start[i], -low), high
        found: dict[int, int] = {}
        while excess:
            # Rows per step from each table's search point on, over all ranks; a table's new
            # floor is one past the step where the rows below it reach its excess.
            pending = sorted(excess)
            counts = torch.from_numpy(np.stack([
                self.tables[i][1].expiry.window(self.tables[i][2], start[i], start[i] + _CHUNK_STEPS)
                for i in pending]))
            dist.all_reduce(counts, group=self.process_group)
            for row, i in enumerate(pending):
                below = np.cumsum(counts[row].numpy())
                reached = np.flatnonzero(below >= excess[i])
                if len(reached):
                    found[i] = start[i] + int(reached[0]) + 1
                    del excess[i]
                    if i in top and found[i] > top[i]:  # as one process would refuse it (RowExpiry)
                        name, group, t = self.tables[i]
                        raise ValueError(f"table {name!r}: more rows than Expiry.max_rows "
                                         f"({int(group.expiry.max_rows[t])}) share the highest score; raise max_rows")
                else:
                    excess[i] -= int(below[-1])
                    start[i] += _CHUNK_STEPS
                    if start[i] > (top[i] if i in top else clock(i)) + 1:  # past every count: none
                        raise RuntimeError(f"table {self.tables[i][0]!r}: the ranks' row counts do not add up "
                                           f"({int(totals[i])} rows live)")
        for i, floor in found.items():
            _, group, t = self.tables[i]
            group.raise_cap_floor(t, floor, clock(i))
