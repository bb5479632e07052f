"""Checkpoints written before :class:`NodeLayout` moved to ``ctr_lightning.node_layout`` name it here."""

from ctr_lightning.node_layout import NodeLayout

__all__ = ["NodeLayout"]
