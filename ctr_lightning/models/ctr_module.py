"""The base LightningModule of every CTR model: tables, losses, metrics, logging, predict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import BinaryAUROC
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from ctr_lightning.batch import Batch
from ctr_lightning.callbacks.auto_placement import auto_placement_by_default
from ctr_lightning.callbacks.table_snapshots import table_snapshots_by_default
from ctr_lightning.datamodules.criteo_schema import NUM_DENSE, SPARSE_NAMES
from ctr_lightning.embedding import Admission, AutoStorage, Expiry, StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.embedding.optimizers import SPARSE_OPTIMIZERS
from ctr_lightning.metrics import Calibration, GroupAUC, LogLoss, NormalizedEntropy

POOLINGS = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
# A checkpoint's model class, for `ctr-lightning ... --ckpt_path` to check the class a run names
# (LightningCLI records it only for models it built itself).
MODEL_CLASS_KEY = "ctr_lightning_model_class"


class CTRModule(pl.LightningModule):
    """What every click-through-rate model repeats: one table per categorical feature in a
    :class:`TieredEmbeddingBagCollection` (any storage, sharding and sparse optimizer), the
    split of dense and sparse parameters, the loss, the quality metrics (AUC, log loss, NE,
    calibration, and GAUC when the data has a grouping column), their logging, and predict.

    A model subclasses it, builds its dense layers after ``super().__init__(**kwargs)`` and
    defines :meth:`forward` from a :class:`~ctr_lightning.Batch` to one logit per example.
    The tables are :attr:`embeddings`, updated by their own fused optimizer inside
    backward; Lightning's optimizer (Adam) trains the rest.

    Args:
        sparse_feature_names: categorical features, one table each (linked from the data by the CLI).
        num_dense_features: continuous features (linked from the data by the CLI).
        embedding_dim: width of every table.
        num_embeddings: expected rows per table: sets the initial scale and the planner's
            shares. Any 64-bit id gets its own row.
        learning_rate: Adam learning rate of the dense part.
        sparse_learning_rate: learning rate of the tables' optimizer (fused into backward).
        sparse_optimizer: ``"adam"``, ``"adagrad"``, ``"rowwise_adagrad"`` or ``"sgd"``.
        pooling: how a multi-hot feature's rows pool into one vector: ``"sum"`` or ``"mean"``.
        storage: tier capacities and SSD directory of the tables; default all in the device tier.
            ``"auto"`` (or an :class:`AutoStorage`): planned from the machine at the start of
            fit by an :class:`~ctr_lightning.callbacks.AutoPlacement` callback, which the model
            adds to the trainer (:meth:`configure_callbacks`): each rank's tier budgets, SSD
            directory and CPUs (the process and its DataLoader workers are pinned to them), the
            plan logged to TensorBoard as text (``placement_plan``).
        seed: initial table weights.
        sharding: how the tables split over ranks in a distributed run (``"row_wise"``,
            ``"table_wise"``, ``"data_parallel"``, ``"auto"``); see :class:`TieredEmbeddingBagCollection`.
        sparse_sync: ``"step"`` (pooled rows travel every step) or ``"k_step"`` (local
            replicas, deltas averaged by the owners every ``sync_every`` steps).
        sync_every: the steps between two merges under ``"k_step"`` (default: the k of a
            ``KStepAdamStrategy``, else 16).
        sync_state_dtype: the dtype Adam's moments of rows travel in under ``"k_step"``
            (``"bfloat16"``, or ``"float32"`` for an exact average).
        admission: which new ids of every table get a row (:class:`Admission`: from the
            N-th sighting, ``admit_after``, or with a ``probability``); default every id.
            Ids not admitted read zeros and are not trained.
        expiry: which stored rows of every table go (:class:`Expiry`: not looked up in
            ``ttl`` training steps or a duration of data time such as ``7d``, or the least
            recent above ``max_rows``); default none.

    Example::

        class TwoTower(CTRModule):
            def __init__(self, hidden: int = 64, **kwargs):
                super().__init__(**kwargs)
                self.mlp = MLP(self.num_dense_features + self.num_sparse_features * self.hparams.embedding_dim,
                               [hidden], output_dim=1)

            def forward(self, batch):
                vectors = self.embed(batch.sparse)                       # [B, F, dim]
                return self.mlp(torch.cat([batch.dense, vectors.flatten(1)], 1)).squeeze(-1)
    """

    first_order: ClassVar[bool] = False
    """When true, every table row holds one more column, the feature's first-order
    (linear) weight, looked up with its vector: :meth:`embed_with_weights` splits it off."""

    def __init__(
        self,
        sparse_feature_names: Sequence[str] = SPARSE_NAMES,
        num_dense_features: int = NUM_DENSE,
        embedding_dim: int = 16,
        num_embeddings: int = 100_000,
        learning_rate: float = 1e-3,
        sparse_learning_rate: float = 0.01,
        sparse_optimizer: str = "adam",
        pooling: str = "sum",
        storage: StorageConfig | AutoStorage | str | None = None,
        seed: int = 0,
        sharding: str = "row_wise",
        sparse_sync: str = "step",
        sync_every: int | None = None,
        sync_state_dtype: str = "bfloat16",
        admission: Admission | None = None,
        expiry: Expiry | None = None,
    ) -> None:
        super().__init__()
        if not sparse_feature_names:
            raise ValueError(f"{type(self).__name__} needs at least one sparse feature")
        if embedding_dim < 1 or num_embeddings < 1:
            raise ValueError(f"embedding_dim and num_embeddings must be >= 1, got {embedding_dim}, {num_embeddings}")
        if num_dense_features < 0:
            raise ValueError(f"num_dense_features must be >= 0, got {num_dense_features}")
        if sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"sparse_optimizer must be one of {sorted(SPARSE_OPTIMIZERS)}, got {sparse_optimizer!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {sorted(POOLINGS)}, got {pooling!r}")
        # Collects the arguments of every __init__ in the chain, the subclass's own included.
        self.save_hyperparameters()
        self.sparse_feature_names = list(sparse_feature_names)
        self.num_sparse_features = len(self.sparse_feature_names)
        self.num_dense_features = num_dense_features
        self.embedding_dim = embedding_dim
        self.table_dim = embedding_dim + (1 if self.first_order else 0)
        tables = [
            EmbeddingBagConfig(name=f"t_{name}", embedding_dim=self.table_dim, num_embeddings=num_embeddings,
                               feature_names=[name], pooling=POOLINGS[pooling])
            for name in self.sparse_feature_names
        ]
        self.embeddings = TieredEmbeddingBagCollection(
            tables, storage=storage, optimizer=SPARSE_OPTIMIZERS[sparse_optimizer](lr=sparse_learning_rate),
            seed=seed, sharding=sharding, sparse_sync=sparse_sync, sync_every=sync_every,
            sync_state_dtype=sync_state_dtype, admission=admission, expiry=expiry)
        self.val_metrics = _quality_metrics()
        self.test_metrics = _quality_metrics()
        self._bytes_before = 0

    # -- what a model defines ----------------------------------------------------------

    def forward(self, batch: Batch) -> torch.Tensor:
        """One logit per example, ``[B]``."""
        raise NotImplementedError(f"{type(self).__name__} must define forward(batch) -> logits [B]")

    # -- what a model uses -------------------------------------------------------------

    def embed(self, sparse: Any) -> torch.Tensor:
        """The pooled vector of every categorical feature of every example: ``[B, F, table_dim]``,
        features in :attr:`sparse_feature_names` order."""
        pooled = self.embeddings(sparse)
        return pooled.values().view(-1, self.num_sparse_features, self.table_dim)

    def embed_with_weights(self, sparse: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """For a :attr:`first_order` model: the features' vectors ``[B, F, embedding_dim]``
        and the sum of their first-order weights ``[B]``."""
        if not self.first_order:
            raise TypeError(f"{type(self).__name__} has no first-order column; set first_order = True")
        rows = self.embed(sparse)
        return rows[..., : self.embedding_dim], rows[..., self.embedding_dim].sum(dim=1)

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters for Lightning's optimizer: everything but the sparse tables."""
        sparse = {id(p) for p in self.embeddings.parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]

    # -- Lightning hooks ---------------------------------------------------------------

    def on_fit_start(self) -> None:
        # Under precision="16-mixed" (CUDA) Lightning scales the loss with a GradScaler; the
        # tables update inside backward, so they unscale (and skip overflowed steps) themselves.
        self.embeddings.set_grad_scaler(getattr(self.trainer.precision_plugin, "scaler", None))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[MODEL_CLASS_KEY] = f"{type(self).__module__}.{type(self).__qualname__}"

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        self.embeddings.observe_labels(batch.labels)  # for scores that count clicks (Expiry(score="show_click"))
        # For a ttl in data time (Expiry(ttl="7d")); every step on every rank alike (collective
        # when sharded and a ttl counts in data time), an empty batch's too.
        times = batch.event_time
        self.embeddings.observe_event_time(float(times.max()) if times is not None and len(times) else None)
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
        # AUC gets probabilities: torchmetrics would guess per batch whether values are logits.
        metrics["auc"].update(torch.sigmoid(logits), labels.long())
        metrics["logloss"].update(logits, labels)
        metrics["ne"].update(logits, labels)
        metrics["calibration"].update(logits, labels)
        if batch.groups is not None:
            metrics["gauc"].update(logits, labels, batch.groups)
        for name, metric in metrics.items():
            if name != "gauc" or metric.update_called:
                self.log(f"{stage}/{name}", metric, prog_bar=name == "auc")
        # The loss is the log loss, from its metric's synced sums: a mean logged with
        # sync_dist would divide an int64 example count by the world size in place
        # (Lightning-AI/pytorch-lightning#21859), and an empty batch (a rank padding its pass
        # until the others finish) would log NaN.
        self.log(f"{stage}/loss", metrics["logloss"])

    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        """Click probabilities ``[B]`` (a :class:`~ctr_lightning.callbacks.ScoreWriter`
        streams them to files)."""
        return torch.sigmoid(self(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=self.hparams.learning_rate)

    def configure_callbacks(self) -> list[pl.Callback]:
        """A :class:`~ctr_lightning.callbacks.TableSnapshots` when the tables have an SSD tier
        and the trainer checkpoints without one: a checkpoint then streams the rows to a
        snapshot instead of gathering tables larger than memory into the ``.ckpt``
        (:func:`~ctr_lightning.callbacks.table_snapshots_by_default`). A TableSnapshots given
        to the trainer is kept as it is; tables held in memory keep their rows in the ``.ckpt``.
        And under ``storage: auto`` an :class:`~ctr_lightning.callbacks.AutoPlacement`, which
        plans the tables' tiers at the start of fit (:func:`~ctr_lightning.callbacks.auto_placement_by_default`),
        unless the trainer has one."""
        return table_snapshots_by_default(self) + auto_placement_by_default(self)


def _quality_metrics() -> nn.ModuleDict:
    return nn.ModuleDict({"auc": BinaryAUROC(), "logloss": LogLoss(), "ne": NormalizedEntropy(),
                          "calibration": Calibration(), "gauc": GroupAUC()})
