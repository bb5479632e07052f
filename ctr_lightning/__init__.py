"""ctr-lightning: terabyte-scale click-through-rate training on PyTorch Lightning.

Example::

    from ctr_lightning import Batch
    from ctr_lightning.datamodules import CriteoDataModule
    from ctr_lightning.models import DLRMModule
"""

from ctr_lightning.batch import Batch

# The modules of every config class a checkpoint may hold (see checkpoint_safe): importing
# ctr_lightning is then enough for torch.load(..., weights_only=True) to rebuild them.
import ctr_lightning.datamodules.synthetic_criteo  # noqa: E402,F401
import ctr_lightning.embedding.optimizers  # noqa: E402,F401
import ctr_lightning.embedding.sharding_plan  # noqa: E402,F401
import ctr_lightning.embedding.storage_config  # noqa: E402,F401
import ctr_lightning.strategies.node_layout  # noqa: E402,F401

__all__ = ["Batch"]
__version__ = "0.1.0"
