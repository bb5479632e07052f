"""CTR metrics beyond torchmetrics' AUC."""

from ctr_lightning.metrics.ctr import Calibration, LogLoss, NormalizedEntropy
from ctr_lightning.metrics.group_auc import GroupAUC, group_auc

__all__ = ["Calibration", "GroupAUC", "LogLoss", "NormalizedEntropy", "group_auc"]
