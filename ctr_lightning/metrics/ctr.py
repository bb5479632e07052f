"""Click-prediction quality metrics that torchmetrics lacks: log loss, normalized entropy and
calibration (PCOC)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric


class LogLoss(Metric):
    """Mean binary cross-entropy of logits against 0/1 labels, synced across ranks.

    Example::

        m = LogLoss()
        m.update(logits, labels)
        m.compute()
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("label_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        labels = labels.to(logits.dtype)
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        self.loss_sum += loss.double()
        self.label_sum += labels.sum().double()
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        return (self.loss_sum / self.count).float()


class NormalizedEntropy(LogLoss):
    """Log loss divided by the entropy of the empirical click rate (He et al., 2014).

    1.0 is no better than predicting the base rate; lower is better.

    Example::

        m = NormalizedEntropy()
        m.update(logits, labels)
        m.compute()
    """

    def compute(self) -> torch.Tensor:
        p = (self.label_sum / self.count).clamp(1e-12, 1 - 1e-12)
        base = -(p * p.log() + (1 - p) * (1 - p).log())
        return (self.loss_sum / self.count / base).float()


class Calibration(Metric):
    """Mean predicted click rate over mean observed click rate (PCOC), synced across ranks.

    1.0 is calibrated; above over-predicts clicks, below under-predicts. Ad systems watch
    it because bids and auctions use the predicted rate itself, not only its ranking.
    NaN while no click was seen.

    Example::

        m = Calibration()
        m.update(logits, labels)
        m.compute()   # e.g. tensor(1.03)
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.add_state("predicted_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("label_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.predicted_sum += torch.sigmoid(logits.double()).sum()
        self.label_sum += labels.double().sum()

    def compute(self) -> torch.Tensor:
        if self.label_sum == 0:
            return torch.tensor(float("nan"))
        return (self.predicted_sum / self.label_sum).float()
