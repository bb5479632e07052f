"""What one k-step merge averages, and in which dtype each part travels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctr_lightning.strategies.hierarchical_average import HierarchicalAverage


@dataclass(frozen=True)
class MergedTensors:
    """The tensors of one merge: parameters and floating buffers, averaged exactly, and
    the optimizer's moments, averaged in ``moment_dtype``.

    Example::

        merged = MergedTensors(params, exact=[p.data for p in params], moments=[s["exp_avg"]],
                               squares=[False], moment_dtype=torch.bfloat16)
        merged.average_with(average)
    """

    params: list[torch.Tensor]  # the optimizer's parameters: their spread is the divergence
    exact: list[torch.Tensor]  # the parameters' data, then the floating buffers
    moments: list[torch.Tensor]  # exp_avg / exp_avg_sq, as the optimizer holds them
    squares: list[bool]  # per moment: must stay non-negative (exp_avg_sq)
    moment_dtype: torch.dtype

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.exact + self.moments

    @property
    def nonnegative(self) -> list[bool]:
        return [False] * len(self.exact) + self.squares

    def with_tensors(self, tensors: list[torch.Tensor]) -> MergedTensors:
        """The same merge over other tensors in the order of :attr:`tensors` (copies of them)."""
        n = len(self.exact)
        return MergedTensors(tensors[: len(self.params)], tensors[:n], tensors[n:], self.squares, self.moment_dtype)

    def distance_from(self, before: list[torch.Tensor]) -> torch.Tensor:
        """``[1]`` relative L2 distance of the parameters ``before`` (in :attr:`params`'
        order) from the parameters now, on their device (NCCL takes no CPU tensors)."""
        now = torch.cat([p.detach().reshape(-1) for p in self.params])
        then = torch.cat([p.detach().reshape(-1) for p in before])
        return ((then - now).norm() / now.norm().clamp_min(1e-12)).reshape(1).float()

    def average_with(self, average: HierarchicalAverage) -> None:
        """Replace every tensor by its mean over the ranks."""
        average(self.exact)
        if self.moments:
            average(self.moments, wire_dtype=self.moment_dtype)
