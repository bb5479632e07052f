"""``storage: auto`` under Lightning: the tables' tiers planned from the machine when a run starts."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ctr_lightning.embedding.tiered import TieredEmbeddingBagCollection
from ctr_lightning.topology import Placement, measure_access, place_tables

DEFAULT_BATCH_SIZE = 4096  # when the DataModule does not say


class AutoPlacement(Callback):
    """Plans the tiers of every ``storage="auto"`` :class:`TieredEmbeddingBagCollection` of
    the LightningModule with ``ctr_lightning.topology.place_tables`` when a run starts:
    after the strategy moved the module to its device and a checkpoint was restored (its
    rows wait for the plan), before the first batch. Each rank takes its share of the free
    GPU memory and of its NUMA node's free DRAM and an SSD directory near it; the plan uses
    the DataModule's ``batch_size`` and, in fit when ``AutoStorage.profile_batches`` asks, the
    id counts of its first training batches (else a Zipf guess).

    Then this process, its threads and the DataLoader workers it starts later are pinned to
    the plan's CPUs, and rank 0 logs the plan to TensorBoard as text (``placement_plan``).
    A :class:`~ctr_lightning.models.CTRModule` with ``storage: auto`` adds one by itself
    (:func:`auto_placement_by_default`).

    Example::

        Trainer(callbacks=[AutoPlacement()]).fit(model_with_auto_storage_tables, datamodule=dm)
    """

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._place(trainer, pl_module, profile=True)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._place(trainer, pl_module)  # planned already within fit

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._place(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._place(trainer, pl_module)

    def _place(self, trainer: pl.Trainer, pl_module: pl.LightningModule, profile: bool = False) -> None:
        waiting = {name: m for name, m in pl_module.named_modules()
                   if isinstance(m, TieredEmbeddingBagCollection) and m.auto_storage is not None and m.placement is None}
        if not waiting:
            return
        datamodule = getattr(trainer, "datamodule", None)
        batch_size = int(getattr(datamodule, "batch_size", None)
                         or (getattr(datamodule, "hparams", None) or {}).get("batch_size") or DEFAULT_BATCH_SIZE)
        placements: dict[str, Placement] = {}
        for name, collection in waiting.items():
            access = None
            if profile and collection.auto_storage.profile_batches and datamodule is not None:
                tables = collection.embedding_bag_configs()
                access = measure_access(datamodule.train_dataloader(), {t.name: list(t.feature_names) for t in tables},
                                        {t.name: t.num_embeddings for t in tables},
                                        collection.auto_storage.profile_batches)
            placements[name] = collection.plan_placement(batch_size, access, placer=place_tables)
        first = next(iter(placements.values()))
        cpus = first.bind_cpus()  # every plan of this rank gives it the same CPUs
        text = "\n\n".join(f"{name}:\n{p.plan.to_text()}" if len(placements) > 1 else p.plan.to_text()
                           for name, p in placements.items())
        rank_zero_info(f"storage auto: rank {trainer.global_rank} on CPUs {list(cpus)}; SSD "
                       f"{first.rank.ssd_dir}\n{text}")
        experiment = getattr(trainer.logger, "experiment", None)
        if trainer.global_rank == 0 and hasattr(experiment, "add_text"):
            # Indented four spaces: TensorBoard renders text as Markdown, and the tables are aligned.
            experiment.add_text("placement_plan", "\n".join("    " + line for line in text.splitlines()))


def auto_placement_by_default(pl_module: pl.LightningModule) -> list[Callback]:
    """What a LightningModule's ``configure_callbacks`` returns so that its ``storage="auto"``
    tables are planned: ``[AutoPlacement()]`` when some :class:`TieredEmbeddingBagCollection`
    of it has storage auto and the trainer has no AutoPlacement of its own; else ``[]``.
    :class:`~ctr_lightning.models.CTRModule` does so.

    Example::

        class MyModel(pl.LightningModule):
            def configure_callbacks(self):
                return auto_placement_by_default(self)
    """
    if any(isinstance(c, AutoPlacement) for c in pl_module.trainer.callbacks):
        return []
    collections = [m for m in pl_module.modules() if isinstance(m, TieredEmbeddingBagCollection)]
    return [AutoPlacement()] if any(c.auto_storage is not None for c in collections) else []
