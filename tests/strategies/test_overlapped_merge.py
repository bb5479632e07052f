import threading
import time

import pytest
import torch

from ctr_lightning.strategies import OverlappedMerge
from ctr_lightning.strategies.merged_tensors import MergedTensors


class Shrink:
    """Stands in for the ranks' average: the other ranks' snapshots were all smaller. The
    first call (the weights) waits for ``release``, as a slow link would."""

    def __init__(self, release: threading.Event | None = None):
        self.wire_dtypes = []
        self.release = release

    def __call__(self, tensors, within_node_only=False, wire_dtype=None):
        if self.release is not None and not self.wire_dtypes:
            self.release.wait(timeout=60)
        self.wire_dtypes.append(wire_dtype)
        for t in tensors:
            t.mul_(0.5)


def test_correction_is_average_minus_snapshot_and_squares_stay_non_negative():
    release = threading.Event()
    shrink = Shrink(release)
    merge = OverlappedMerge(shrink)
    weights, squares = torch.tensor([4.0, -2.0]), torch.tensor([1.0, 3.0])
    merge.launch(MergedTensors([weights], [weights], [squares], [True], torch.bfloat16))
    assert merge.pending
    weights += 1.0  # local steps while the merge travels
    squares -= torch.tensor([0.0, 2.5])
    released_at = []

    def let_go():
        time.sleep(0.3)
        released_at.append(time.perf_counter())
        release.set()

    threading.Thread(target=let_go).start()
    called_at = time.perf_counter()
    divergence, waited = merge.apply()
    # x + (0.5 * snapshot - snapshot)
    assert weights.tolist() == [5.0 - 2.0, -1.0 + 1.0]
    assert squares.tolist() == [1.0 - 0.5, 0.0]  # 0.5 - 1.5 clamped at 0
    # The snapshot's distance from its average, |s - 0.5 s| / |0.5 s| = 1, is itself averaged
    # over the ranks, which the stand-in does by halving.
    assert divergence == pytest.approx(0.5)
    # apply() cannot return before the average arrives: it reports at least the time from
    # the call to the release (less the moment between reading the clock here and in apply).
    assert waited >= (released_at[0] - called_at) * 1000 - 50
    assert shrink.wire_dtypes[:2] == [None, torch.bfloat16]  # weights exactly, moments in their dtype
    assert merge.apply() is None and not merge.pending
    merge.close()
