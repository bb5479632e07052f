"""CTR models as LightningModules."""

from ctr_lightning.models.dlrm import DLRMModule

__all__ = ["DLRMModule"]
