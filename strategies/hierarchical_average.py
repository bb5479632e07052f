"""Averages of many tensors over all ranks, in flat buckets, node by node."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ctr_lightning.node_layout import NodeLayout


@dataclass
class CommBytes:
    """Bytes this rank sent, inside its node and to other nodes."""

    intra_node: int = 0
    inter_node: int = 0


def buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors of at most ``bucket_bytes`` (at least one each)."""
    run: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if run and (size + nbytes > bucket_bytes or t.dtype != run[0].dtype or t.device != run[0].device):
            yield run
            run, size = [], 0
        run.append(t)
        size += nbytes
    if run:
        yield run


class HierarchicalAverage:
    """Replaces tensors by their mean over all ranks with three collectives per bucket:
    reduce-scatter inside the node, all-reduce of each slice across nodes, all-gather
    inside the node. Each node then sends 1/local_world_size of the bytes a flat
    all-reduce would send across nodes.

    Example::

        average = HierarchicalAverage(layout, intra_group, cross_group)
        average([p.data for p in model.parameters()])
        average(moments, wire_dtype=torch.bfloat16)  # half the bytes
        average.bytes.inter_node
    """

    def __init__(self, layout: NodeLayout, intra: dist.ProcessGroup | None, cross: dist.ProcessGroup | None,
                 bucket_bytes: int = 25 << 20) -> None:
        self.layout = layout
        self.intra = intra
        self.cross = cross
        self.bucket_bytes = bucket_bytes
        self.bytes = CommBytes()

    def __call__(self, tensors: Sequence[torch.Tensor], within_node_only: bool = False,
                 wire_dtype: torch.dtype | None = None) -> None:
        """Average ``tensors`` in place; with ``wire_dtype`` each bucket travels (and is
        summed) in that dtype, and the result is cast back."""
        for run in buckets(tensors, self.bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in run])
            if wire_dtype is not None:
                flat = flat.to(wire_dtype)
            if within_node_only:
                self._all_reduce(flat, self.intra, self.layout.local_world_size, intra=True)
                flat /= self.layout.local_world_size
            else:
                flat = self._average(flat)
            offset = 0
            for t in run:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _average(self, flat: torch.Tensor) -> torch.Tensor:
        size, n = self.layout.local_world_size, self.layout.num_nodes
        if size == 1:
            self._all_reduce(flat, self.cross, n, intra=False)
            return flat / self.layout.world_size
        padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % size))
        piece = torch.empty(padded.numel() // size, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(piece, padded, group=self.intra)
        self.bytes.intra_node += _ring_bytes(padded, size) // 2
        if n > 1:
            self._all_reduce(piece, self.cross, n, intra=False)
        gathered = torch.empty_like(padded)
        dist.all_gather_into_tensor(gathered, piece, group=self.intra)
        self.bytes.intra_node += _ring_bytes(padded, size) // 2
        return gathered[: flat.numel()] / self.layout.world_size

    def _all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup | None, ranks: int, intra: bool) -> None:
        if ranks <= 1:
            return
        dist.all_reduce(flat, group=group)
        if intra:
            self.bytes.intra_node += _ring_bytes(flat, ranks)
        else:
            self.bytes.inter_node += _ring_bytes(flat, ranks)


def _ring_bytes(t: torch.Tensor, ranks: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``t`` over ``ranks`` ranks."""
    return 2 * (ranks - 1) * t.numel() * t.element_size() // ranks
