"""Row updates under a loss-scaling ``torch.amp.GradScaler`` (float16 mixed precision).

The sparse optimizer runs inside backward, before the scaler has looked at any gradient,
so the scaler's two jobs are done here for the rows: the gradient reaching the tables is
divided by the scale the loss was multiplied by, and a step whose gradient overflowed
updates no row (the scaler skips that step for the dense parameters too).
"""

from __future__ import annotations

import functools
import warnings

import torch


def unscale_in_backward(pooled: torch.Tensor, scaler: torch.amp.GradScaler) -> None:
    """Have backward hand the tables under ``pooled`` (a collection's output) its gradient
    divided by ``scaler``'s scale. A gradient with any value not finite is handed on as NaN
    throughout, so every table it reaches skips its update: all tables of the step alike,
    on every owner when the tables are sharded (each owner receives a part of it), as the
    scaler skips every dense parameter. The tables skip a non-finite gradient while the
    collection's engine is told so (``TableEngine.skip_nonfinite_updates``)."""
    if pooled.requires_grad:
        pooled.register_hook(functools.partial(_unscaled, scaler))


def _unscaled(scaler: torch.amp.GradScaler, grad: torch.Tensor) -> torch.Tensor:
    # The reciprocal in float64, then one multiplication, as the scaler unscales dense
    # gradients: with its power-of-two scales the result is exact. get_scale syncs on CUDA.
    grad = grad * (1.0 / scaler.get_scale())
    if not bool(torch.isfinite(grad).all()):
        return torch.full_like(grad, float("nan"))
    return grad


def warn_if_loss_may_be_scaled(device: torch.device, module_name: str) -> None:
    """Warn when a training forward runs under float16 autocast with no scaler handed to the
    tables: float16 training scales the loss (Lightning's ``precision="16-mixed"`` does), and
    unscaled, the rows would step on gradients thousands of times too large, and turn NaN
    on the steps the scaler skips."""
    if torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.float16:
        warnings.warn(
            f"{module_name}: training under float16 autocast with no GradScaler handed to set_grad_scaler(). If the "
            f"loss is scaled (Lightning's precision='16-mixed' scales it), the sparse optimizer steps on scaled "
            f"gradients; call set_grad_scaler(scaler) with the scaler that scales the loss (under Lightning: "
            f"trainer.precision_plugin.scaler), or set_grad_scaler(GradScaler(enabled=False)) if it is not scaled.",
            stacklevel=3)
