import pytest

from ctr_lightning.node_layout import NodeLayout


def test_ranks_split_into_whole_nodes():
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        NodeLayout.of(world_size=6, rank=0, local_world_size=4)
    layout = NodeLayout.of(world_size=4, rank=3, local_world_size=2)
    assert (layout.node, layout.local_rank, layout.num_nodes) == (1, 1, 2)
