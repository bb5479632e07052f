"""ctr-lightning: terabyte-scale click-through-rate training on PyTorch Lightning.

Example::

    from ctr_lightning import Batch
    from ctr_lightning.datamodules import CriteoDataModule
    from ctr_lightning.models import DLRMModule
"""

from ctr_lightning.batch import Batch

__all__ = ["Batch"]
__version__ = "0.1.0"
