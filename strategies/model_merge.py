"""KStepAdamStrategy's merges of the whole model over the ranks: at once, or overlapped with training."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ctr_lightning.strategies.adam_moments import AMSGRAD_MAX, ParamMoments, adopt, agree_moments
from ctr_lightning.strategies.hierarchical_average import HierarchicalAverage
from ctr_lightning.strategies.merged_tensors import MergedTensors
from ctr_lightning.strategies.overlapped_merge import OverlappedMerge


SQUARES = ("exp_avg_sq", AMSGRAD_MAX)  # moments that must stay non-negative


class ModelMerge:
    """Averages the whole model over all ranks: the parameters of every optimizer (so that
    the ranks end equal whichever optimizer stepped last), the floating-point buffers and,
    with ``merge_optimizer_state``, Adam's moments of each parameter any rank has stepped
    (zeros where a rank has not: see :class:`ParamMoments`). Counts the merges and the
    ranks' divergence from the merged model.

    Parameters are averaged exactly, in float32. Adam's moments travel (and are summed)
    as ``moment_dtype``, bfloat16 by default, which cuts a merge from three model-sized
    messages to two. They are running statistics: each reduction hop rounds the running
    sum to bfloat16's 8 significant bits (2^-9 relative), so with a few ranks an averaged
    ``exp_avg_sq`` lands within about 0.4% of its float32 average (``exp_avg`` within
    that share of its inputs' magnitude, as opposite signs cancel), and the difference
    fades as the moments decay. bfloat16 keeps float32's exponent range, so small
    ``exp_avg_sq`` do not flush to zero as they would in float16.

    With ``overlapped`` (an :class:`OverlappedMerge` on process groups of its own) a
    merge applies the one in flight and starts the next.

    Example::

        merging = ModelMerge(average, torch.bfloat16, merge_optimizer_state=True, device=device, world_size=4)
        merging.merge(optimizers, module)  # collective: {"kstep/merge_ms": ..., "kstep/divergence": ...}
    """

    def __init__(self, average: HierarchicalAverage, moment_dtype: torch.dtype, merge_optimizer_state: bool,
                 device: torch.device, world_size: int, overlapped: OverlappedMerge | None = None) -> None:
        self.average, self.moment_dtype, self.merge_optimizer_state = average, moment_dtype, merge_optimizer_state
        self.device, self.world_size, self.overlapped = device, world_size, overlapped
        self.merges = 0
        self.last_divergence: float | None = None

    def agreed_moments(self, optimizers: Sequence[Optimizer]) -> list[ParamMoments]:
        """Adam's state of every parameter any rank has stepped, alike on every rank
        (collective); none without ``merge_optimizer_state``."""
        if not self.merge_optimizer_state:
            return []
        return agree_moments(optimizers, self.device, self.world_size)

    def tensors(self, optimizers: Sequence[Optimizer], module: torch.nn.Module,
                moments: list[ParamMoments]) -> MergedTensors:
        """The whole model: every optimizer's parameters, ``module``'s floating buffers and ``moments``."""
        # In parameter order, the same on every rank (a state dict's order is not).
        params = [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
        exact = [p.data for p in params] + [b for b in module.buffers() if b.is_floating_point()]
        named = [(name, t) for m in moments for name, t in m.moments.items()]
        return MergedTensors(params, exact, [t for _, t in named], [name in SQUARES for name, _ in named],
                             self.moment_dtype)

    def _tensors_adopted(self, optimizers: Sequence[Optimizer], module: torch.nn.Module) -> MergedTensors:
        """The whole model for a merge of the live tensors: each optimizer first holds the
        agreed Adam state (zero moments where it had none), which the merge then averages."""
        moments = self.agreed_moments(optimizers)
        adopt(moments)
        return self.tensors(optimizers, module, moments)

    def merge(self, optimizers: Sequence[Optimizer], module: torch.nn.Module) -> dict[str, float]:
        """Average the model over all ranks now (collective); returns merge metrics."""
        start = time.perf_counter()
        merged_tensors = self._tensors_adopted(optimizers, module)
        local = [p.detach().clone() for p in merged_tensors.params]
        merged_tensors.average_with(self.average)
        divergence = merged_tensors.distance_from(local)
        dist.all_reduce(divergence)
        self.last_divergence = float(divergence) / self.world_size
        self.merges += 1
        return {"kstep/merge_ms": (time.perf_counter() - start) * 1000.0, "kstep/divergence": self.last_divergence}

    def merge_overlapped(self, optimizers: Sequence[Optimizer], module: torch.nn.Module) -> dict[str, float]:
        """Apply the merge in flight, then start the next one; ``kstep/merge_ms`` is the
        time training stood still for it (waiting, correcting, snapshotting)."""
        start = time.perf_counter()
        metrics = self.apply_overlapped()
        self.overlapped.launch(self._tensors_adopted(optimizers, module))
        metrics["kstep/merge_ms"] = (time.perf_counter() - start) * 1000.0
        return metrics

    def apply_overlapped(self) -> dict[str, float]:
        """Apply the overlapped merge in flight, if any; returns its metrics."""
        applied = self.overlapped.apply() if self.overlapped is not None else None
        if applied is None:
            return {}
        self.last_divergence, waited = applied
        self.merges += 1
        return {"kstep/divergence": self.last_divergence, "kstep/merge_wait_ms": waited}
