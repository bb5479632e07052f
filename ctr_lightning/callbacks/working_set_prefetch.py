"""The working-set prefetcher in a Lightning fit, with its counters on TensorBoard."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from typing_extensions import override

from ctr_lightning.callbacks.tiered_collections import tiered_collections
from ctr_lightning.embedding.counters import sum_counters
from ctr_lightning.embedding.prefetch.working_set_prefetcher import WorkingSetPrefetcher
from ctr_lightning.embedding.tiered import TieredEmbeddingBagCollection


class WorkingSetPrefetch(Callback):
    """Reads ``lookahead`` training batches ahead and brings their rows in from SSD
    while the current ones train (see :class:`WorkingSetPrefetcher`).

    It wraps the train dataloader (from a DataModule, the LightningModule or
    ``fit(train_dataloaders=...)``) and finds every :class:`TieredEmbeddingBagCollection`
    in the LightningModule. Sharded collections read ahead at the rows' owners. Logged
    per step:

    - ``prefetch/hit_rate``: of the rows that had to come from SSD, the share already read ahead;
    - ``prefetch/ssd_stall_ms``: time the step waited on SSD reads, its own or unfinished reads ahead;
    - ``prefetch/bytes_read``: bytes the prefetch thread read.

    Example::

        Trainer(callbacks=[WorkingSetPrefetch(lookahead=8)])
    """

    def __init__(self, lookahead: int = 8) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.lookahead = lookahead
        self.prefetcher: WorkingSetPrefetcher | None = None
        self._collections: list[TieredEmbeddingBagCollection] = []
        self._last: dict[str, int] = {}

    def _totals(self) -> dict[str, int]:
        return sum_counters(c.tier_stats() for c in self._collections)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._collections = tiered_collections(pl_module, "WorkingSetPrefetch")
        # Wrapped where Lightning asks for the train dataloader: the fit loop makes its
        # iterator (and fetches the first batch) before any epoch hook runs, so a loader
        # wrapped in on_train_epoch_start would miss the first epoch. No public hook hands a
        # callback the train dataloader before that, hence the fit loop's private source.
        source = trainer.fit_loop._data_source
        trainer.fit_loop._data_source = _PrefetchedSource(source.instance, source.name, self._wrap)

    def _wrap(self, loader: Any) -> WorkingSetPrefetcher:
        if isinstance(loader, WorkingSetPrefetcher):
            return loader
        if isinstance(loader, (list, tuple, dict)):
            raise ValueError("WorkingSetPrefetch needs exactly one train dataloader")
        return WorkingSetPrefetcher(loader, self._collections, lookahead=self.lookahead)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        source = trainer.fit_loop._data_source
        if isinstance(source, _PrefetchedSource):
            trainer.fit_loop._data_source = _DataLoaderSource(source.instance, source.name)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = trainer.fit_loop._combined_loader
        if loaders is None or len(loaders.flattened) != 1:
            raise ValueError("WorkingSetPrefetch needs exactly one train dataloader")
        loader = loaders.flattened[0]
        if not isinstance(loader, WorkingSetPrefetcher):
            raise RuntimeError("WorkingSetPrefetch: the train dataloader was not wrapped at setup")
        self.prefetcher = loader
        self._last = self._totals()
        self._last["ssd_stall_us"] += loader.wait_us

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.prefetcher is None:
            return
        self.prefetcher.batch_done()
        now = self._totals()
        now["ssd_stall_us"] += self.prefetcher.wait_us
        delta = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        from_ssd = delta["prefetch_hits"] + delta["ssd_hits"]
        size = len(batch) if hasattr(batch, "__len__") else None
        pl_module.log("prefetch/hit_rate", delta["prefetch_hits"] / from_ssd if from_ssd else 1.0,
                      on_step=True, on_epoch=False, batch_size=size)
        pl_module.log("prefetch/ssd_stall_ms", delta["ssd_stall_us"] / 1000.0, on_step=True, on_epoch=False,
                      batch_size=size)
        pl_module.log("prefetch/bytes_read", float(delta["prefetch_bytes"]), on_step=True, on_epoch=False,
                      batch_size=size)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()


@dataclass
class _PrefetchedSource(_DataLoaderSource):
    """Lightning's train dataloader source, with the loader it returns wrapped."""

    wrap: Callable[[Any], Any] | None = None

    @override
    def dataloader(self) -> Any:
        loader = super().dataloader()
        return loader if self.wrap is None else self.wrap(loader)
