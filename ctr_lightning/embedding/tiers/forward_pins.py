"""Device-tier rows that training forwards hold until their backward has updated them."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import numpy as np

from ctr_lightning.embedding.tiers.row_cache import TierFull


class ForwardPins:
    """The device-tier slots of training forwards whose backward is to come: eviction must
    spare them, or the backward would update rows that are no longer there.

    Example::

        pins = ForwardPins()
        release = pins.pin(slots, holder=row_update)  # in forward
        pins.held()                                    # [slots]: spared by eviction
        release()                                      # in backward: the update is done
    """

    def __init__(self) -> None:
        # By pin number. A dict: a pin may be released from whichever thread frees its
        # forward's autograd graph, and one dict operation is atomic under the GIL.
        self._pins: dict[int, np.ndarray] = {}
        self._numbers = itertools.count()

    def pin(self, slots: np.ndarray, holder: object) -> Callable[[], None]:
        """Keep these device rows in place: a training forward's update is to come in its
        backward. Returns the release, which runs once: when called (the update is done) or
        when ``holder`` is garbage collected, whichever comes first. ``holder`` is an object
        only the forward's autograd graph keeps, so a forward whose backward never comes (a
        skipped batch, an exception before backward) gives its rows back when its output
        and graph are freed."""
        number = next(self._numbers)
        self._pins[number] = slots
        release = weakref.finalize(holder, self._pins.pop, number, None)
        release.atexit = False  # nothing to give back at exit
        return release

    def held(self) -> list[np.ndarray]:
        """The slots of each forward still waiting for its backward."""
        return list(self._pins.values())

    @staticmethod
    def blame(full: TierFull, held: list[np.ndarray], table_code: np.ndarray, names: list[str]) -> TierFull:
        """The error for a tier that rows of earlier forwards (``held``) fill, not the batch
        (``full`` itself when they hold none of that table's rows); ``table_code``: the
        tier's table of each slot, plus one."""
        by_forward = [slots[table_code[slots].astype(np.int64) - 1 == full.table] for slots in held]
        forwards = sum(1 for slots in by_forward if len(slots))
        rows = len(np.unique(np.concatenate(by_forward)))
        if not rows:
            return full
        return TierFull(
            f"table {names[full.table]!r}: the batches in flight touch more rows than its tier holds "
            f"({full.touched} rows, capacity {full.capacity} rows), {rows} of them held by {forwards} earlier training "
            f"forwards whose backward has not run. A training forward holds its rows until its backward, or until its "
            f"output (and anything computed from it, such as the loss) is freed: a step that skips backward must not "
            f"keep them. Several forwards before one backward (gradient accumulation, pipelining) need a tier that "
            f"holds all their rows: raise the capacity",
            full.table, full.touched, full.capacity)
