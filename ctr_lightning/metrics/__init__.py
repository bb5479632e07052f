"""CTR metrics beyond torchmetrics' AUC."""

from ctr_lightning.metrics.ctr import Calibration, LogLoss, NormalizedEntropy

__all__ = ["Calibration", "LogLoss", "NormalizedEntropy"]
