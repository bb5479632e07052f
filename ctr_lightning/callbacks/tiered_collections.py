"""The tiered table collections a LightningModule holds, for the callbacks that watch them."""

from __future__ import annotations

import lightning.pytorch as pl

from ctr_lightning.embedding.tiered import TieredEmbeddingBagCollection


def tiered_collections(pl_module: pl.LightningModule, owner: str) -> list[TieredEmbeddingBagCollection]:
    """Every :class:`TieredEmbeddingBagCollection` of ``pl_module`` (each once); an error
    naming ``owner`` when there is none."""
    collections = [m for m in pl_module.modules() if isinstance(m, TieredEmbeddingBagCollection)]
    if not collections:
        raise ValueError(f"{owner}: {type(pl_module).__name__} has no TieredEmbeddingBagCollection")
    return collections
