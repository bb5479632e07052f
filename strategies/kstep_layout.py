"""KStepAdamStrategy's node layout: how many ranks form one "node" of the k-step merge."""

from __future__ import annotations

import os

import torch.distributed as dist

from ctr_lightning.node_layout import NodeLayout


def kstep_layout(local_world_size: int | str | None, world_size: int, rank: int, devices_per_node: int) -> NodeLayout:
    """``local_world_size`` ranks a node; ``"nvlink"``: an NVLink island of the machine is
    a node, as rank 0 reads the islands (collective; the whole node where they are
    unknown, unequal or single GPUs); ``None``: the launcher's ``LOCAL_WORLD_SIZE``, else
    Lightning's ``devices_per_node``.

    Example::

        layout = kstep_layout("nvlink", world_size=8, rank=0, devices_per_node=8)
    """
    local = local_world_size
    if local == "nvlink":
        from ctr_lightning.topology import discover
        from ctr_lightning.topology.hardware_placement import nvlink_group_size

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", devices_per_node))
        found = [nvlink_group_size(discover(), per_node) if rank == 0 else None]
        if world_size > 1:
            dist.broadcast_object_list(found, src=0)
        local = found[0]
    if local is None and "LOCAL_WORLD_SIZE" not in os.environ:
        local = devices_per_node
    return NodeLayout.of(world_size, rank, local)
