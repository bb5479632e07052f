"""Named points on the paths where a crash costs the most, at which a crash test kills this
process, with SIGKILL, for real.

``CTR_LIGHTNING_KILL_AT="<point>:<n>"`` kills the process at its n-th arrival at
``<point>``. The points: ``train_step`` (a training forward done, its backward not),
``ssd_write`` (rows half-way into an SSD segment: an eviction's write-back),
``ssd_clean`` (live rows of a segment being cleaned copied, the segment not yet
retired), ``snapshot_rows`` (a table snapshot's row file half written) and
``snapshot_manifest`` (every row file of a snapshot written, its manifest not).
Without the variable, as in every real run, :func:`reached` returns at once.

Example::

    CTR_LIGHTNING_KILL_AT=ssd_clean:3 ctr-lightning fit --config run.yaml   # dies in an SSD cleaning
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = ("train_step", "ssd_write", "ssd_clean", "snapshot_rows", "snapshot_manifest")


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("CTR_LIGHTNING_KILL_AT")
    if not spec:
        return None
    point, _, n = spec.partition(":")
    if point not in POINTS or not n.isdigit() or int(n) < 1:
        raise ValueError(f"CTR_LIGHTNING_KILL_AT={spec!r}: expected '<point>:<n>' with n >= 1 and a point "
                         f"of {POINTS}")
    return point, int(n)


_TARGET = _target()
_arrivals = 0
_lock = threading.Lock()  # SSD writes arrive from the write-behind thread


def reached(point: str) -> None:
    """Arrival at ``point``: the process dies here if the crash test asked for it."""
    global _arrivals
    if _TARGET is None or point != _TARGET[0]:
        return
    with _lock:
        _arrivals += 1
        if _arrivals == _TARGET[1]:
            os.kill(os.getpid(), signal.SIGKILL)
