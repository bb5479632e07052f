"""Lightning strategies: k-step model merging for Adam (the paper's communication cut).

Importing this package registers ``"kstep_adam"`` with Lightning's strategy registry, so
``Trainer(strategy="kstep_adam")`` and ``--trainer.strategy kstep_adam`` work.
"""

from lightning.pytorch.strategies import StrategyRegistry

from ctr_lightning.merge_schedule import MergeSchedule
from ctr_lightning.node_layout import NodeLayout
from ctr_lightning.strategies.kstep_adam import KStepAdamStrategy
from ctr_lightning.strategies.kstep_monitor import KStepMonitor
from ctr_lightning.strategies.overlapped_merge import OverlappedMerge

KStepAdamStrategy.register_strategies(StrategyRegistry)

__all__ = ["KStepAdamStrategy", "KStepMonitor", "MergeSchedule", "NodeLayout", "OverlappedMerge"]
