"""A checkpoint saved between k-step merges holds the merged model, built from copies."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from ctr_lightning.strategies.adam_moments import ParamMoments
from ctr_lightning.strategies.hierarchical_average import HierarchicalAverage
from ctr_lightning.strategies.merged_tensors import MergedTensors


class CheckpointMerge:
    """Averages copies of the ranks' models (and Adam moments) into a checkpoint's state.

    Every rank builds a Lightning checkpoint (rank 0 writes it), so between merges each
    rank averages copies of its tensors over all ranks and swaps them into the state
    dicts; the live tensors are left alone, so saving does not change training. Moments
    are averaged only when an optimizer's state is asked for (not for weights-only saves),
    once for all optimizers, and the copies are dropped with :meth:`clear`. The saved
    state is what a merge would leave: moments of a parameter this rank never stepped
    are the others' mean with zeros for it, step counts the largest (:class:`ParamMoments`).

    Example::

        merge = CheckpointMerge(average, moment_dtype=torch.bfloat16)
        state = merge.model_state(module_state, merged_tensors, moments)     # the ranks' mean
        opt_state = merge.optimizer_state(optimizer_state, optimizer)        # mean moments
        merge.clear()                                                        # at the next step
    """

    def __init__(self, average: HierarchicalAverage, moment_dtype: torch.dtype) -> None:
        self.average = average
        self.moment_dtype = moment_dtype
        self._live: MergedTensors | None = None
        self._moments: list[ParamMoments] = []
        self._merged_moments: dict[int, torch.Tensor] | None = None

    def clear(self) -> None:
        self._live = self._merged_moments = None
        self._moments = []

    def model_state(self, state: dict[str, Any], live: MergedTensors, moments: list[ParamMoments]) -> dict[str, Any]:
        """``state`` (a module state dict of views of ``live``'s tensors) with the ranks'
        mean in place of each; collective. ``moments``: the Adam states whose moments are
        ``live.moments``, for :meth:`optimizer_state`."""
        self.clear()
        with torch.inference_mode(False), torch.no_grad():
            exact = [t.detach().clone() for t in live.exact]
            self.average(exact)
        copies = {(t.data_ptr(), t.shape, t.dtype): m for t, m in zip(live.exact, exact) if t.numel()}
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel():
                state[name] = copies.get((value.data_ptr(), value.shape, value.dtype), value)
        self._live = live
        self._moments = moments
        return state

    def optimizer_state(self, state: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s state dict with the ranks' mean moments and agreed step counts,
        after :meth:`model_state` (unchanged otherwise); collective the first time it changes
        anything."""
        if self._live is None or not self._live.moments or "state" not in state:
            return state
        if self._merged_moments is None:  # the first optimizer asked: average every optimizer's moments once
            with torch.inference_mode(False), torch.no_grad():
                copies = [t.detach().clone() for t in self._live.moments]
                self.average(copies, wire_dtype=self.moment_dtype)
            self._merged_moments = {id(t): m for t, m in zip(self._live.moments, copies)}
        merged = self._merged_moments
        inner = getattr(optimizer, "_optimizer", optimizer)
        # New dicts: the optimizer's state_dict shares its per-parameter dicts with the optimizer.
        per_param = dict(state["state"])
        for m in self._moments:
            if m.optimizer is inner:
                per_param[m.index] = {name: merged.get(id(value), value) for name, value in m.state.items()}
        return {**state, "state": per_param}
