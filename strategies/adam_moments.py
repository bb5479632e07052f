"""Adam's moments in a k-step merge: one entry per parameter any rank has stepped, alike on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.optimizer import _get_scalar_dtype

MOMENT_NAMES = ("exp_avg", "exp_avg_sq")
# With amsgrad, the running maximum of exp_avg_sq, which the update divides by: merged like the
# moments, or each rank would step with its own denominator after every merge.
AMSGRAD_MAX = "max_exp_avg_sq"


@dataclass(frozen=True)
class ParamMoments:
    """One parameter's Adam state as a merge leaves it, before its moments are averaged.

    A parameter that got no gradient on a rank (another tower, an unused layer) has no
    Adam state there, while another rank may hold some. Every rank then takes part with
    zero moments, as DDP counts a missing gradient as zero, and every rank leaves with
    the step count of the rank that stepped the parameter most, so that the ranks'
    states are equal after the merge and the averages see the same tensors in the same
    order on every rank.

    Example::

        moments = agree_moments(optimizers, device, world_size)  # collective
        adopt(moments)                                           # zeros where a rank held none
        average([t for m in moments for t in m.moments.values()], wire_dtype=torch.bfloat16)
    """

    optimizer: Optimizer  # torch's optimizer, not Lightning's wrapper
    param: torch.Tensor
    index: int  # the parameter's key in ``optimizer.state_dict()["state"]``
    state: dict[str, torch.Tensor]  # the parameter's state after the merge (moments: this rank's, or zeros)
    held: bool  # whether this rank's optimizer holds state for the parameter

    @property
    def moments(self) -> dict[str, torch.Tensor]:
        """``exp_avg`` and ``exp_avg_sq`` (and with amsgrad ``max_exp_avg_sq``: the mean of
        the ranks' maxima stays above the mean ``exp_avg_sq``), the tensors a merge averages."""
        names = MOMENT_NAMES + ((AMSGRAD_MAX,) if AMSGRAD_MAX in self.state else ())
        return {name: self.state[name] for name in names}


def agree_moments(optimizers: Sequence[Optimizer], device: torch.device, world_size: int) -> list[ParamMoments]:
    """The Adam state of every parameter of ``optimizers`` that any rank holds, in the
    optimizers' parameter order (the same on every rank); collective (one all-reduce of
    a number per parameter). Changes no optimizer: see :func:`adopt`."""
    inner = [getattr(optimizer, "_optimizer", optimizer) for optimizer in optimizers]
    entries = [(optimizer, group, p, index) for optimizer in inner
               for index, (group, p) in enumerate((g, p) for g in optimizer.param_groups for p in g["params"])]
    # step + 1 where this rank holds state, 0 where not; float64 counts steps exactly to 2^53.
    steps = torch.tensor([float(optimizer.state[p]["step"]) + 1 if p in optimizer.state else 0.0
                          for optimizer, _, p, _ in entries], dtype=torch.float64, device=device)
    if world_size > 1 and len(steps):
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    agreed = []
    for (optimizer, group, p, index), step in zip(entries, steps.tolist()):
        if step == 0:  # no rank has stepped it: it stays without state, as Adam leaves it
            continue
        own = optimizer.state.get(p)
        state = dict(own) if own is not None else _zero_state(group, p)
        state["step"] = _step_like(own["step"] if own is not None else None, group, p, step - 1)
        agreed.append(ParamMoments(optimizer, p, index, state, held=own is not None))
    return agreed


def adopt(moments: Sequence[ParamMoments]) -> None:
    """Make each optimizer hold the merge's state (zero moments where it held none, the
    agreed step counts), so that averaging :attr:`ParamMoments.moments` in place merges it."""
    for m in moments:
        m.optimizer.state[m.param] = m.state


def _zero_state(group: dict, p: torch.Tensor) -> dict[str, torch.Tensor]:
    # What Adam's first step would make, before it adds the gradient.
    names = MOMENT_NAMES + ((AMSGRAD_MAX,) if group.get("amsgrad") else ())
    return {name: torch.zeros_like(p, memory_format=torch.preserve_format) for name in names}


def _step_like(own: torch.Tensor | None, group: dict, p: torch.Tensor, value: float) -> torch.Tensor:
    if own is not None:
        return torch.full_like(own, value)
    # Where Adam keeps a step count it makes itself: on the parameter's device when
    # capturable or fused, else a CPU scalar.
    if group.get("capturable") or group.get("fused"):
        return torch.full((), value, dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device)
    return torch.tensor(value, dtype=_get_scalar_dtype())
