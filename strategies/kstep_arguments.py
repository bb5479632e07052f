"""KStepAdamStrategy's arguments (and optimizers) checked, and DDPStrategy's arguments for its model wrapper refused.

The strategy has no DistributedDataParallel wrapper, so the arguments DDPStrategy hands to
one would be silently ignored: they are refused, each with its reason. Lightning's own
periodic averaging (``DDPStrategy(model_averaging_period=k)``, post-local SGD) is not built
on because it averages the parameters alone, leaving each rank's Adam moments apart, and on
CPU Lightning never installs its hook.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ctr_lightning.merge_schedule import MergeSchedule

MOMENT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_DDP_COMM_HOOK_ARGUMENTS = frozenset({"ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"})


def merge_schedule(k: int, warmup_steps: int) -> MergeSchedule:
    """The schedule of merges every ``k`` steps after ``warmup_steps`` synchronous ones;
    a ``ValueError`` naming the strategy for bad values."""
    try:
        return MergeSchedule(k=k, warmup_steps=warmup_steps)
    except ValueError as e:
        raise ValueError(f"KStepAdamStrategy: {e}") from None


def check_arguments(mode: str, local_world_size: int | str | None, bucket_bytes: int, moment_dtype: str) -> None:
    """Refuse bad values of the strategy's own arguments, saying which are allowed."""
    if mode not in ("all", "node"):
        raise ValueError(f"KStepAdamStrategy: mode must be 'all' or 'node', got {mode!r}")
    if isinstance(local_world_size, str) and local_world_size != "nvlink":
        raise ValueError(f"KStepAdamStrategy: local_world_size must be an int, 'nvlink' or None, "
                         f"got {local_world_size!r}")
    if bucket_bytes < 1:
        raise ValueError(f"KStepAdamStrategy: bucket_bytes must be >= 1, got {bucket_bytes}")
    if moment_dtype not in MOMENT_DTYPES:
        raise ValueError(f"KStepAdamStrategy: moment_dtype must be one of {sorted(MOMENT_DTYPES)} (float16 "
                         f"would flush small exp_avg_sq to zero), got {moment_dtype!r}")


def check_optimizer(optimizer: Optimizer, merge_optimizer_state: bool) -> None:
    """Refuse an optimizer whose state a merge cannot merge: ``merge_optimizer_state`` takes Adam's."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    if merge_optimizer_state and not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(
            f"KStepAdamStrategy: merge_optimizer_state=True merges Adam's exp_avg and exp_avg_sq, but the "
            f"optimizer is {type(inner).__name__}; use Adam/AdamW or merge_optimizer_state=False")


def refuse_ddp_arguments(arguments: dict[str, Any]) -> None:
    """Refuse the arguments DDPStrategy hands to its DistributedDataParallel wrapper (or
    uses on it): without a wrapper they would be silently ignored."""
    wrapper_arguments = inspect.signature(DistributedDataParallel.__init__).parameters
    refused, unknown = [], []
    for name in sorted(arguments):
        if name in _DDP_COMM_HOOK_ARGUMENTS:
            refused.append(f"{name} (a DDP communication hook: this strategy averages gradients itself, every step "
                           f"only with k=1, in warm-up, or inside a node with mode='node')")
        elif name == "model_averaging_period":
            refused.append(f"{name} (DDP's post-local-SGD model averaging: this strategy merges the models every k "
                           f"steps; set k)")
        elif name in wrapper_arguments:
            refused.append(f"{name} (an argument of DistributedDataParallel, which this strategy does not wrap the "
                           f"model in)")
        else:
            unknown.append(name)
    if unknown:
        raise TypeError(f"KStepAdamStrategy got unexpected keyword arguments: {', '.join(unknown)}")
    if refused:
        raise ValueError(f"KStepAdamStrategy has no DDP wrapper, so it does not take {'; '.join(refused)}")
