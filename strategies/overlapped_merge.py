"""Model merges that travel while training goes on (overlap local SGD)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ctr_lightning.strategies.hierarchical_average import HierarchicalAverage
from ctr_lightning.strategies.merged_tensors import MergedTensors


@dataclass
class _Pending:
    tensors: list[torch.Tensor]  # the live tensors the merge will correct
    snapshot: list[torch.Tensor]  # their values when the merge started
    averaged: list[torch.Tensor]  # the snapshot, averaged over ranks by the background thread
    nonnegative: list[bool]
    done: Future


class OverlappedMerge:
    """Averages a snapshot of the model in a background thread while the next ``k``
    local steps run, then moves every rank by the same correction.

    At merge ``m`` each rank snapshots ``S_m`` (parameters, floating buffers, optimizer
    moments) and the ranks start averaging it over their own process groups. At merge
    ``m + 1`` each rank waits for ``avg(S_m)`` and sets ``x += avg(S_m) - S_m``: its
    own progress since the snapshot, on top of the average (Wang et al., "Overlap
    Local-SGD", ICASSP 2020). The merge's bytes then cost time only where they take
    longer than ``k`` steps of compute. Values that must stay non-negative (Adam's
    ``exp_avg_sq``) are clamped at 0 after the correction.

    Example::

        merge = OverlappedMerge(HierarchicalAverage(layout, *layout.process_groups()))
        merge.apply()                      # the previous merge's correction, if any
        merge.launch(MergedTensors(params, exact, moments, squares, torch.bfloat16))
    """

    def __init__(self, average: HierarchicalAverage) -> None:
        self.average = average  # its own process groups: the main thread keeps using the others
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kstep-merge")
        self._pending: _Pending | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def launch(self, merged: MergedTensors) -> None:
        """Start averaging the current values of ``merged``'s tensors."""
        if self._pending is not None:
            raise RuntimeError("OverlappedMerge.launch: apply the previous merge first")
        tensors = merged.tensors
        snapshot = [t.detach().clone() for t in tensors]
        averaged = [s.clone() for s in snapshot]
        done = self._executor.submit(self._average, merged.with_tensors(averaged), snapshot[: len(merged.params)])
        self._pending = _Pending(tensors, snapshot, averaged, merged.nonnegative, done)

    def _average(self, averaged: MergedTensors, local_params: list[torch.Tensor]) -> float:
        averaged.average_with(self.average)
        divergence = averaged.distance_from(local_params)
        self.average([divergence])
        return float(divergence)

    def apply(self) -> tuple[float, float] | None:
        """Wait for the merge in flight and correct the live tensors by it; returns
        ``(divergence of the ranks at its snapshot, ms waited)``, or None if none was in flight."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        start = time.perf_counter()
        divergence = pending.done.result()
        waited = (time.perf_counter() - start) * 1000.0
        with torch.no_grad():
            for t, before, after, nonnegative in zip(pending.tensors, pending.snapshot, pending.averaged,
                                                     pending.nonnegative):
                t.add_(after - before)
                if nonnegative:
                    t.clamp_(min=0)
        return divergence, waited

    def close(self) -> None:
        """Drop a merge still in flight (its thread finishes it) and stop the thread."""
        self._pending = None
        self._executor.shutdown(wait=True)
