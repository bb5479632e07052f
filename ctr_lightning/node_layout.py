"""Which ranks share a node, and the process groups inside and across nodes."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from ctr_lightning.checkpoint_safe import checkpoint_safe


@checkpoint_safe(formerly="ctr_lightning.strategies.node_layout")
@dataclass(frozen=True)
class NodeLayout:
    """Ranks ``[node * local_world_size, (node + 1) * local_world_size)`` share a node.

    Example::

        layout = NodeLayout.of(world_size=4, rank=3, local_world_size=2)
        layout.node, layout.local_rank, layout.num_nodes    # 1, 1, 2
    """

    world_size: int
    rank: int
    local_world_size: int

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    @staticmethod
    def of(world_size: int, rank: int, local_world_size: int | None = None) -> NodeLayout:
        """The layout from ``local_world_size``, else the launcher's ``LOCAL_WORLD_SIZE``."""
        if local_world_size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            local_world_size = int(env) if env else world_size
        if local_world_size < 1 or world_size % local_world_size:
            raise ValueError(f"local_world_size {local_world_size} does not divide the world size {world_size} "
                             f"into whole nodes")
        return NodeLayout(world_size, rank, local_world_size)

    def process_groups(self, backend: str | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """``(this node's group, the group of the ranks with this local rank on every node)``.

        Collective over all ranks: each creates every group, in the same order.
        """
        n, size = self.num_nodes, self.local_world_size
        intra = cross = None
        for node in range(n):
            group = dist.new_group(list(range(node * size, (node + 1) * size)), backend=backend)
            if node == self.node:
                intra = group
        for local in range(size):
            group = dist.new_group([node * size + local for node in range(n)], backend=backend)
            if local == self.local_rank:
                cross = group
        return intra, cross
