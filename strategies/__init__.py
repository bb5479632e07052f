"""Lightning strategies: k-step model merging for Adam (the paper's communication cut)."""

from ctr_lightning.strategies.kstep_adam import KStepAdamStrategy
from ctr_lightning.strategies.node_layout import NodeLayout
from ctr_lightning.strategies.overlapped_merge import OverlappedMerge

__all__ = ["KStepAdamStrategy", "NodeLayout", "OverlappedMerge"]
