"""ctr-lightning: terabyte-scale click-through-rate training on PyTorch Lightning.

Example::

    from ctr_lightning import Batch
    from ctr_lightning.datamodules import CriteoDataModule
    from ctr_lightning.models import DLRMModule
"""

import os

# Idle OpenMP threads (torch's and numba's) sleep instead of spinning: the SSD tier's
# read and write threads need the cores they would spin on (measured by
# benchmarks/bench_out_of_core.py --skip checkpoint --compare-spinning; docs/benchmarks.md).
# Each OpenMP runtime reads it when it loads: torch's when torch is imported (so it holds
# for torch only when ctr_lightning comes first, as in the ctr-lightning command), numba's
# at its first parallel kernel. Child processes inherit it. GOMP_SPINCOUNT=300000 restores
# libgomp's default spinning.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

try:
    import torch  # noqa: F401
except ImportError:  # a serving host: ctr_lightning.serving reads exports with numpy and pyarrow alone
    __all__: list[str] = []
else:
    from ctr_lightning.batch import Batch  # noqa: E402

    # The modules of every config class a checkpoint may hold (see checkpoint_safe): importing
    # ctr_lightning is then enough for torch.load(..., weights_only=True) to rebuild them.
    # None of them imports Lightning, so `import ctr_lightning.embedding` stays light.
    import ctr_lightning.embedding.optimizers  # noqa: E402,F401
    import ctr_lightning.embedding.sharding_plan  # noqa: E402,F401
    import ctr_lightning.embedding.storage_config  # noqa: E402,F401
    import ctr_lightning.node_layout  # noqa: E402,F401
    import ctr_lightning.synthetic_criteo_spec  # noqa: E402,F401

    __all__ = ["Batch"]
__version__ = "0.1.0"
