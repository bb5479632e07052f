"""CTR metrics beyond torchmetrics' AUC."""

from ctr_lightning.metrics.ctr import LogLoss, NormalizedEntropy

__all__ = ["LogLoss", "NormalizedEntropy"]
