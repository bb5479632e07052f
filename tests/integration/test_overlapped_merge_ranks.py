
import pytest
import torch



RANK_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from ctr_lightning.node_layout import NodeLayout
from ctr_lightning.strategies import OverlappedMerge
from ctr_lightning.strategies.hierarchical_average import HierarchicalAverage
from ctr_lightning.strategies.merged_tensors import MergedTensors

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
layout = NodeLayout.of(world_size=2, rank=rank, local_world_size=2)
merge = OverlappedMerge(HierarchicalAverage(layout, *layout.process_groups(), bucket_bytes=16))
g = torch.Generator().manual_seed(rank)
weights = torch.randn(10, generator=g)
squares = torch.rand(10, generator=g)
snapshot = (weights.clone(), squares.clone())
merge.launch(MergedTensors([weights], [weights], [squares], [True], torch.float32))
weights += 0.25 * (rank + 1)  # local steps while the average travels
squares *= 0.5
divergence, waited = merge.apply()
print("RESULT " + json.dumps({"snapshot": [t.tolist() for t in snapshot], "after": [weights.tolist(), squares.tolist()],
                              "divergence": divergence}), flush=True)
merge.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_gloo_ranks_apply_the_average_of_their_snapshots(run_ranks):
    results = run_ranks(RANK_SCRIPT, ["{port}"], world=2, ddp_env=False)
    snapshots = [[torch.tensor(t) for t in r["snapshot"]] for r in results]
    mean = [(a + b) / 2 for a, b in zip(*snapshots)]
    for rank, result in enumerate(results):
        weights, squares = (torch.tensor(t) for t in result["after"])
        own_weights, own_squares = snapshots[rank]
        local_weights = own_weights + 0.25 * (rank + 1)
        torch.testing.assert_close(weights, local_weights + mean[0] - own_weights, atol=1e-6, rtol=0)
        torch.testing.assert_close(squares, (own_squares * 0.5 + mean[1] - own_squares).clamp(min=0), atol=1e-6,
                                   rtol=0)
    # Both report the mean over ranks of each snapshot's distance from the average.
    distances = [float((s[0] - mean[0]).norm() / mean[0].norm()) for s in snapshots]
    for result in results:
        assert result["divergence"] == pytest.approx(sum(distances) / 2, rel=1e-5)
