"""A DLRM click-through-rate model as a LightningModule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import BinaryAUROC
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.batch import Batch
from ctr_lightning.datamodules.criteo_schema import NUM_DENSE, SPARSE_NAMES
from ctr_lightning.embedding import AutoStorage, SparseAdam, StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.metrics import Calibration, LogLoss, NormalizedEntropy



class DLRMModule(pl.LightningModule):
    """DLRM (Naumov et al., 2019): bottom MLP, sparse embeddings, dot interaction, top MLP.

    The sparse part is one module, :attr:`embeddings`, with torchrec's
    EmbeddingBagCollection interface, updated by its own fused sparse optimizer;
    Lightning's optimizer (Adam) trains the dense part only.

    Args:
        sparse_feature_names: categorical features, one table each (linked from the data by the CLI).
        num_dense_features: continuous features (linked from the data by the CLI).
        embedding_dim: width of every table; also the bottom MLP's output width.
        num_embeddings: expected rows per table: sets the initial scale and the planner's
            shares. Any 64-bit id gets its own row.
        dense_arch_layer_sizes: bottom MLP; the last size is set to ``embedding_dim``.
        over_arch_layer_sizes: top MLP; the last size must be 1.
        learning_rate: Adam learning rate of the dense part.
        sparse_learning_rate: Adam learning rate of the tables (fused into backward).
        storage: tier capacities and SSD directory of the tables; default all in the device tier.
            ``"auto"`` (or an :class:`AutoStorage`): planned from the machine at the start of
            fit (``ctr_lightning.topology``): each rank's tier budgets, SSD directory and CPUs
            (the process and its DataLoader workers are pinned to them), the plan logged to
            TensorBoard as text (``placement_plan``).
        seed: initial table weights.
        sharding: how the tables split over ranks in a distributed run (``"row_wise"``,
            ``"table_wise"``, ``"auto"``); see :class:`TieredEmbeddingBagCollection`.
        sparse_sync, sync_every: ``"step"`` (pooled rows travel every step) or ``"k_step"``
            (local replicas, deltas averaged by the owners every ``sync_every`` steps; default: the
            k of a ``KStepAdamStrategy``, else 16).
        sync_state_dtype: the dtype Adam's moments of rows travel in under ``"k_step"``
            (``"bfloat16"``, or ``"float32"`` for an exact average).

    Example::

        model = DLRMModule(embedding_dim=16, num_embeddings=100_000)
        logits = model(batch)           # [B]
        Trainer(max_steps=100).fit(model, datamodule=CriteoDataModule(...))
    """

    def __init__(
        self,
        sparse_feature_names: Sequence[str] = SPARSE_NAMES,
        num_dense_features: int = NUM_DENSE,
        embedding_dim: int = 16,
        num_embeddings: int = 100_000,
        dense_arch_layer_sizes: Sequence[int] = (64,),
        over_arch_layer_sizes: Sequence[int] = (128, 64, 1),
        learning_rate: float = 1e-3,
        sparse_learning_rate: float = 0.01,
        storage: StorageConfig | AutoStorage | str | None = None,
        seed: int = 0,
        sharding: str = "row_wise",
        sparse_sync: str = "step",
        sync_every: int | None = None,
        sync_state_dtype: str = "bfloat16",
    ) -> None:
        super().__init__()
        if not sparse_feature_names:
            raise ValueError("DLRMModule needs at least one sparse feature")
        if list(over_arch_layer_sizes)[-1:] != [1]:
            raise ValueError(f"over_arch_layer_sizes must end in 1 (one logit), got {list(over_arch_layer_sizes)}")
        if embedding_dim < 1 or num_embeddings < 1:
            raise ValueError(f"embedding_dim and num_embeddings must be >= 1, got {embedding_dim}, {num_embeddings}")
        self.save_hyperparameters()
        tables = [
            EmbeddingBagConfig(name=f"t_{name}", embedding_dim=embedding_dim,
                               num_embeddings=num_embeddings, feature_names=[name])
            for name in sparse_feature_names
        ]
        self.embeddings = TieredEmbeddingBagCollection(
            tables, storage=storage, optimizer=SparseAdam(lr=sparse_learning_rate), seed=seed, sharding=sharding,
            sparse_sync=sparse_sync, sync_every=sync_every, sync_state_dtype=sync_state_dtype)
        self.dlrm = DLRM(
            embedding_bag_collection=self.embeddings,
            dense_in_features=num_dense_features,
            dense_arch_layer_sizes=[*dense_arch_layer_sizes, embedding_dim],
            over_arch_layer_sizes=list(over_arch_layer_sizes),
        )
        self.val_metrics = _quality_metrics()
        self.test_metrics = _quality_metrics()
        self._bytes_before = 0

    def on_fit_start(self) -> None:
        placement = self._place_tables()
        if placement is None:
            return
        cpus = placement.bind_cpus()
        text = placement.plan.to_text()
        rank_zero_info(f"storage auto: rank {self.global_rank} on CPUs {list(cpus)}; SSD "
                       f"{placement.rank.ssd_dir}\n{text}")
        experiment = getattr(self.logger, "experiment", None)
        if self.global_rank == 0 and hasattr(experiment, "add_text"):
            # Indented four spaces: TensorBoard renders text as Markdown, and the tables are aligned.
            experiment.add_text("placement_plan", "\n".join("    " + line for line in text.splitlines()))

    def _place_tables(self) -> Any:
        """Plan the tables' tiers under ``storage: auto``, with the data's batch size and, when
        asked, id counts of its first batches."""
        auto = self.embeddings.auto_storage
        if auto is None:
            return None
        datamodule = getattr(self.trainer, "datamodule", None)
        batch_size = (getattr(datamodule, "batch_size", None)
                      or (getattr(datamodule, "hparams", None) or {}).get("batch_size") or 4096)
        access = None
        if auto.profile_batches and datamodule is not None:
            from ctr_lightning.topology import measure_access

            tables = self.embeddings.embedding_bag_configs()
            access = measure_access(datamodule.train_dataloader(), {t.name: list(t.feature_names) for t in tables},
                                    {t.name: t.num_embeddings for t in tables}, auto.profile_batches)
        return self.embeddings.plan_placement(int(batch_size), access)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.dlrm(batch.dense, batch.sparse).squeeze(-1)

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters for Lightning's optimizer: everything but the sparse tables."""
        sparse = {id(p) for p in self.embeddings.parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        return loss

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        self._bytes_before = self.embeddings.comm_bytes()

    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        # After backward: the bytes this rank's all-to-alls sent in this step (0 unsharded).
        sent = self.embeddings.comm_bytes() - self._bytes_before
        if sent:
            self.log("comm/embedding_bytes_per_step", float(sent), batch_size=len(batch))

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_metrics)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_metrics)

    def _evaluate(self, batch: Batch, stage: str, metrics: nn.ModuleDict) -> None:
        logits = self(batch)
        labels = batch.labels
        self.log(f"{stage}/loss", F.binary_cross_entropy_with_logits(logits, labels),
                 batch_size=len(batch), sync_dist=True)
        # AUC gets probabilities: torchmetrics would guess per batch whether values are logits.
        metrics["auc"].update(torch.sigmoid(logits), labels.long())
        metrics["logloss"].update(logits, labels)
        metrics["ne"].update(logits, labels)
        metrics["calibration"].update(logits, labels)
        for name, metric in metrics.items():
            self.log(f"{stage}/{name}", metric, prog_bar=name == "auc")

    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return torch.sigmoid(self(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=self.hparams.learning_rate)


def _quality_metrics() -> nn.ModuleDict:
    return nn.ModuleDict({"auc": BinaryAUROC(), "logloss": LogLoss(), "ne": NormalizedEntropy(),
                          "calibration": Calibration()})
