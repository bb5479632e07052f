"""Sparse optimizer steps on the rows one batch touched, with the state stored beside each row."""

from __future__ import annotations

import numpy as np
import torch

from ctr_lightning.embedding.kernels import cpu_kernels as kernels

from ctr_lightning.embedding.optimizers import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseOptimizer, SparseSGD


def state_width(optimizer: SparseOptimizer, dim: int) -> int:
    """Floats of optimizer state stored after the ``dim`` weights of each row."""
    if isinstance(optimizer, RowWiseAdagrad):
        return 1
    if isinstance(optimizer, SparseAdagrad):
        return dim
    if isinstance(optimizer, SparseAdam):
        return 2 * dim
    if isinstance(optimizer, SparseSGD):
        return 0
    raise TypeError(f"unknown sparse optimizer config {optimizer!r}")


def apply_update(optimizer: SparseOptimizer, rows: torch.Tensor, grad: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The updated ``[n, dim + state]`` rows, given their ``[n, dim]`` gradient.

    ``step`` is each row's table step count after this step (for Adam's bias correction,
    as in ``torch.optim.SparseAdam``, where the count is per table, not per row).
    """
    dim = grad.shape[1]
    w = rows[:, :dim]
    out = rows.clone()
    if isinstance(optimizer, RowWiseAdagrad):
        acc = rows[:, dim] + grad.pow(2).mean(1)
        out[:, dim] = acc
        out[:, :dim] = w - optimizer.lr * grad / (acc.sqrt() + optimizer.eps).unsqueeze(1)
    elif isinstance(optimizer, SparseAdagrad):
        acc = rows[:, dim:] + grad.pow(2)
        out[:, dim:] = acc
        out[:, :dim] = w - optimizer.lr * grad / (acc.sqrt() + optimizer.eps)
    elif isinstance(optimizer, SparseAdam):
        beta1, beta2 = optimizer.betas
        m = rows[:, dim : 2 * dim]
        v = rows[:, 2 * dim :]
        # The operation order of torch.optim.SparseAdam, so results agree to the last bits.
        m_new = m + (grad - m) * (1 - beta1)
        v_new = v + (grad.pow(2) - v) * (1 - beta2)
        # Bias corrections in float64, as torch.optim.SparseAdam (Python floats) and the fused
        # CPU kernel compute them: in float32, 1 - 0.999**step is off by up to 1e-5 relative.
        step = step.to(torch.float64).unsqueeze(1)
        step_size = (optimizer.lr * (1 - beta2**step).sqrt() / (1 - beta1**step)).to(grad.dtype)
        out[:, dim : 2 * dim] = m_new
        out[:, 2 * dim :] = v_new
        out[:, :dim] = w - step_size * (m_new / (v_new.sqrt() + optimizer.eps))
    elif isinstance(optimizer, SparseSGD):
        out[:, :dim] = w - optimizer.lr * grad
    else:
        raise TypeError(f"unknown sparse optimizer config {optimizer!r}")
    return out


def kernel_optimizer(opt: SparseOptimizer) -> tuple[int, np.ndarray]:
    """The fused CPU kernel's optimizer code and (lr, eps, beta1, beta2)."""
    if isinstance(opt, RowWiseAdagrad):
        return kernels.ROWWISE_ADAGRAD, np.array([opt.lr, opt.eps, 0, 0], dtype=np.float32)
    if isinstance(opt, SparseAdagrad):
        return kernels.ADAGRAD, np.array([opt.lr, opt.eps, 0, 0], dtype=np.float32)
    if isinstance(opt, SparseAdam):
        return kernels.ADAM, np.array([opt.lr, opt.eps, *opt.betas], dtype=np.float32)
    if isinstance(opt, SparseSGD):
        return kernels.SGD, np.array([opt.lr, 0, 0, 0], dtype=np.float32)
    raise TypeError(f"unknown sparse optimizer config {opt!r}")
