"""Gradients averaged over the ranks before a step, as DDP with ``find_unused_parameters=True`` averages them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ctr_lightning.strategies.hierarchical_average import HierarchicalAverage


def average_gradients(optimizer: Optimizer, average: HierarchicalAverage, device: torch.device,
                      within_node_only: bool) -> None:
    """Average the gradients of ``optimizer``'s parameters over all ranks (over the node's
    with ``within_node_only``), collective: the ranks first agree which parameters have
    one anywhere; those are averaged in parameter order, a missing one counting as zero;
    the others keep none, so Adam skips them on every rank.

    Example::

        average_gradients(optimizer, HierarchicalAverage(layout, intra, cross), device, within_node_only=False)
    """
    if within_node_only and average.layout.local_world_size == 1:
        return  # a node of one rank: nothing to average with
    params = [p for group in optimizer.param_groups for p in group["params"]]
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(present, op=dist.ReduceOp.MAX, group=average.intra if within_node_only else None)
    grads = []
    for p, anywhere in zip(params, present.tolist()):
        if anywhere:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    average(grads, within_node_only=within_node_only)
