import torch

from ctr_lightning.strategies import OverlappedMerge
from ctr_lightning.strategies.merged_tensors import MergedTensors


class Shrink:
    """Stands in for the ranks' average: the other ranks' snapshots were all smaller."""

    def __init__(self):
        self.wire_dtypes = []

    def __call__(self, tensors, within_node_only=False, wire_dtype=None):
        self.wire_dtypes.append(wire_dtype)
        for t in tensors:
            t.mul_(0.5)


def test_correction_is_average_minus_snapshot_and_squares_stay_non_negative():
    shrink = Shrink()
    merge = OverlappedMerge(shrink)
    weights, squares = torch.tensor([4.0, -2.0]), torch.tensor([1.0, 3.0])
    merge.launch(MergedTensors([weights], [weights], [squares], [True], torch.bfloat16))
    assert merge.pending
    weights += 1.0  # local steps while the merge travels
    squares -= torch.tensor([0.0, 2.5])
    divergence, waited = merge.apply()
    # x + (0.5 * snapshot - snapshot)
    assert weights.tolist() == [5.0 - 2.0, -1.0 + 1.0]
    assert squares.tolist() == [1.0 - 0.5, 0.0]  # 0.5 - 1.5 clamped at 0
    assert divergence > 0 and waited >= 0
    assert shrink.wire_dtypes[:2] == [None, torch.bfloat16]  # weights exactly, moments in their dtype
    assert merge.apply() is None and not merge.pending
    merge.close()
