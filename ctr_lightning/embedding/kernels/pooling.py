"""Pooling of a table group's rows into bags, and the sparse optimizer step in its backward.

Two paths, one result: fused numba kernels that read and update the storage in place
(CPU), and generic torch ops (CUDA, or ``kernel="torch"``). Either way the gradient of
the pooled output goes straight to the optimizer step on the touched rows; nothing flows
back to a parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ctr_lightning.embedding.kernels import cpu_kernels as kernels
from ctr_lightning.embedding.kernels.sparse_update import apply_update, kernel_optimizer, state_width
from ctr_lightning.embedding.optimizers import SparseAdam, SparseOptimizer


@dataclass(frozen=True)
class BagLayout:
    """One batch of one table group: its unique rows and how they fill the bags.

    ``slots[inverse]`` is the device-tier slot of each id (-1: a row not admitted, read
    as zeros and not updated); bags are feature-major (``offsets`` has
    ``features * batch + 1`` entries).
    """

    slots: np.ndarray
    inverse: np.ndarray
    offsets: torch.Tensor
    weights: torch.Tensor | None
    batch: int


class CpuBackward:
    """What the fused CPU optimizer step needs: the batch's layout and the output gradient."""

    def __init__(self, layout: BagLayout, offsets: np.ndarray, weights: np.ndarray, grad_out: np.ndarray) -> None:
        self.layout, self.offsets, self.weights, self.grad_out = layout, offsets, weights, grad_out


def pool_cpu(storage: torch.Tensor, dim: int, mean: bool, layout: BagLayout,
             on_grad: Callable[[CpuBackward], None] | None) -> torch.Tensor:
    """``[batch, features * dim]`` pooled by the fused kernel; with ``on_grad``, backward
    hands :class:`CpuBackward` to it (the fused optimizer step)."""
    offsets = layout.offsets.numpy().astype(np.int64, copy=False)
    weights = (layout.weights.numpy().astype(np.float32, copy=False) if layout.weights is not None
               else np.empty(0, dtype=np.float32))

    def pool() -> torch.Tensor:
        out = torch.empty(layout.batch, (len(offsets) - 1) // layout.batch * dim)
        kernels.pool_forward(storage.numpy(), dim, layout.slots, layout.inverse, offsets, weights, mean,
                             layout.batch, out.numpy())
        return out

    if on_grad is None:
        return pool()
    return _FusedCpuPooling.apply(_PLACEHOLDER, pool, lambda grad: on_grad(CpuBackward(layout, offsets, weights, grad)))


def pool_torch(storage: torch.Tensor, dim: int, mode: str, layout: BagLayout,
               on_grad: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
    """The same with torch ops on the storage's device; backward hands the ``[unique rows,
    dim]`` gradient to ``on_grad``."""
    device = storage.device
    slots = torch.from_numpy(layout.slots).to(device)
    gathered = storage[:, :dim].index_select(0, slots.clamp(min=0))
    if bool((slots < 0).any()):
        gathered[slots < 0] = 0.0
    inverse = torch.from_numpy(layout.inverse).to(device)
    offsets = layout.offsets.to(device)
    weights = None if layout.weights is None else layout.weights.to(device, torch.float32)
    if on_grad is None:
        pooled = F.embedding_bag(inverse, gathered, offsets, mode=mode, per_sample_weights=weights,
                                 include_last_offset=True)
    else:
        gathered.requires_grad_(True)  # so autograd reaches _PooledRows.backward
        pooled = _PooledRows.apply(gathered, inverse, offsets, weights, mode, on_grad)
    batch = layout.batch
    return pooled.reshape(-1, batch, dim).transpose(0, 1).reshape(batch, -1)


def update_cpu(storage: torch.Tensor, dim: int, mean: bool, optimizer: SparseOptimizer, steps: np.ndarray,
               tables: np.ndarray, ctx: CpuBackward) -> None:
    """The fused optimizer step on the rows of ``ctx``'s batch (``tables``: the table of
    each unique row; ``steps``: each table's step count, this step included)."""
    kind, params = kernel_optimizer(optimizer)
    layout = ctx.layout
    step_scale = np.zeros(len(layout.slots), dtype=np.float32)
    if isinstance(optimizer, SparseAdam):
        beta1, beta2 = optimizer.betas
        step = steps.astype(np.float64)  # one bias correction per table, then per row
        step_scale = (optimizer.lr * np.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)).astype(np.float32)[tables]
    row_ptr, positions = kernels.occurrences_by_row(layout.inverse, len(layout.slots))
    bag = kernels.bag_of_ids(ctx.offsets, len(layout.inverse))
    kernels.backward_update(storage.numpy(), dim, layout.slots, row_ptr, positions, bag, ctx.offsets, ctx.weights,
                            mean, layout.batch, ctx.grad_out, kind, params, step_scale)


def update_torch(storage: torch.Tensor, optimizer: SparseOptimizer, steps: np.ndarray, slots: np.ndarray,
                 tables: np.ndarray, grad: torch.Tensor) -> None:
    """The optimizer step with torch ops, on the storage's device (not necessarily the
    gradient's)."""
    device = storage.device
    if (slots < 0).any():  # rows not admitted take no step
        keep = np.flatnonzero(slots >= 0)
        slots, tables, grad = slots[keep], tables[keep], grad[torch.from_numpy(keep).to(grad.device)]
    index = torch.from_numpy(slots).to(device)
    rows = storage.index_select(0, index)
    step = torch.from_numpy(steps[tables]).to(device)
    core = grad.shape[1] + state_width(optimizer, grad.shape[1])  # floats after it (a row's stamp) stay
    rows[:, :core] = apply_update(optimizer, rows[:, :core], grad.to(device), step)
    storage.index_copy_(0, index, rows)


# Autograd only calls a Function's backward when an input needs a gradient.
_PLACEHOLDER = torch.zeros(0, requires_grad=True)


class _FusedCpuPooling(torch.autograd.Function):
    """Pooling by the fused kernel; backward runs the fused optimizer kernel."""

    @staticmethod
    def forward(ctx, placeholder, pool, on_grad):  # type: ignore[override]
        ctx.on_grad = on_grad
        return pool()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        ctx.on_grad(grad_out.contiguous().numpy())
        return None, None, None


class _PooledRows(torch.autograd.Function):
    """Pooling of gathered rows whose backward hands each row's summed gradient to ``on_grad``.

    The gradient is accumulated with one index_add over all ids, cheaper than
    embedding_bag's own backward, which builds a gradient for a weight that is thrown away.
    """

    @staticmethod
    def forward(ctx, rows, inverse, offsets, weights, mode, on_grad):  # type: ignore[override]
        ctx.save_for_backward(inverse, offsets, weights)
        ctx.mode, ctx.on_grad, ctx.num_rows = mode, on_grad, rows.shape[0]
        return F.embedding_bag(inverse, rows, offsets, mode=mode, per_sample_weights=weights,
                               include_last_offset=True)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        inverse, offsets, weights = ctx.saved_tensors
        lengths = offsets[1:] - offsets[:-1]
        bag_of_id = torch.repeat_interleave(torch.arange(len(lengths), device=grad_out.device), lengths)
        per_id = grad_out.index_select(0, bag_of_id)
        if weights is not None:
            per_id = per_id * weights.unsqueeze(1)
        if ctx.mode == "mean":
            per_id = per_id / lengths.index_select(0, bag_of_id).unsqueeze(1).to(per_id.dtype)
        grad_rows = torch.zeros(ctx.num_rows, grad_out.shape[1], dtype=grad_out.dtype, device=grad_out.device)
        grad_rows.index_add_(0, inverse, per_id)
        ctx.on_grad(grad_rows)
        return None, None, None, None, None, None
