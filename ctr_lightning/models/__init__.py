"""CTR models as LightningModules, all on :class:`CTRModule`'s tiered tables."""

from ctr_lightning.models.ctr_module import CTRModule
from ctr_lightning.models.dcn_v2 import DCNv2Module
from ctr_lightning.models.deepfm import DeepFMModule
from ctr_lightning.models.dlrm import DLRMModule
from ctr_lightning.models.wide_deep import WideDeepModule

MODELS = (DLRMModule, DCNv2Module, DeepFMModule, WideDeepModule)
"""The models ``ctr-lightning fit --model NAME`` offers."""

__all__ = ["CTRModule", "DCNv2Module", "DLRMModule", "DeepFMModule", "MODELS", "WideDeepModule"]
