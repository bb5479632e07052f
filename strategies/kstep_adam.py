"""KStepAdamStrategy: every rank steps its own Adam; every k steps the models are merged."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from ctr_lightning.node_layout import NodeLayout
from ctr_lightning.strategies.checkpoint_merge import CheckpointMerge
from ctr_lightning.strategies.gradient_average import average_gradients
from ctr_lightning.strategies.hierarchical_average import HierarchicalAverage
from ctr_lightning.strategies.kstep_arguments import (MOMENT_DTYPES, check_arguments, check_optimizer, merge_schedule,
                                                  refuse_ddp_arguments)
from ctr_lightning.strategies.kstep_layout import kstep_layout
from ctr_lightning.strategies.kstep_monitor import KStepMonitor
from ctr_lightning.strategies.model_merge import ModelMerge
from ctr_lightning.strategies.overlapped_merge import OverlappedMerge

Mode = Literal["all", "node"]
MomentDtype = Literal["bfloat16", "float32"]


class KStepAdamStrategy(DDPStrategy):
    """k-step model merging for Adam (Baidu, arXiv 2201.05500), as a Lightning strategy.

    Every rank runs its own optimizer on its own batches. Every ``k`` optimizer steps the
    ranks average their parameters and, unless ``merge_optimizer_state=False``, Adam's
    ``exp_avg`` and ``exp_avg_sq`` (and with ``amsgrad`` ``max_exp_avg_sq``; step counts stay
    equal: every rank takes every step).

    Modes:

    - ``"all"``: no communication between merges.
    - ``"node"``: gradients are averaged inside each node every step, so a node's ranks
      stay identical; the merge every k steps runs across nodes.

    Merges (and the per-step averages of ``k=1`` and of warm-up) are hierarchical:
    reduce-scatter inside the node, all-reduce of each slice across nodes, all-gather
    inside the node, over flat buckets of ``bucket_bytes``. ``k=1`` is synchronous data
    parallel training: gradients are averaged over all ranks before every step, as DDP
    does. The first ``warmup_steps`` steps are synchronous too.

    Parameters that get no gradient on some ranks (data-dependent branches, a tower some
    batches skip) are handled as DDP with ``find_unused_parameters=True`` handles them
    (:func:`average_gradients`): ``k=1`` equals DDP step for step. Merges average every parameter,
    and Adam's moments of each parameter any rank has stepped, zeros where a rank has
    not (see :class:`ParamMoments`). ``find_unused_parameters`` is accepted and changes
    nothing; the arguments that configure DDP's model wrapper (``ddp_comm_hook``,
    ``model_averaging_period``, ``static_graph``...) are refused: there is no wrapper
    (see :mod:`kstep_arguments`).

    Parameters are averaged exactly, in float32. Adam's moments travel (and are summed)
    as ``moment_dtype``: bfloat16 by default, which cuts a merge from three model-sized
    messages to two, within about 0.4% of the float32 average (see :class:`ModelMerge`);
    ``moment_dtype="float32"`` averages them exactly.

    With ``overlap=True`` a merge no longer stops training: each rank snapshots its model
    and the average of the snapshots travels in a background thread during the next
    ``k`` steps; at the next merge every rank adds ``average - snapshot`` to its model
    (:class:`OverlappedMerge`). The merged model arrives ``k`` steps late, so ranks carry
    their last ``k`` local steps on top of it.

    A merge averages the whole model: the parameters of every optimizer, whichever
    stepped last. The ranks also merge whatever they stepped since the last merge when
    validation starts during fit and when fit ends, so validation, the checkpoint after it
    and the model fit returns are the one merged model (:meth:`merge_local_steps`; it
    runs after callbacks' own ``on_validation_start`` / ``on_train_end``). Merges every
    k steps keep their schedule. A checkpoint saved between merges holds the merged model
    and moments as well, averaged from copies, so saving it does not change training
    (:meth:`lightning_module_state_dict`).

    The node layout is ``local_world_size`` ranks per node (default: the launcher's
    ``LOCAL_WORLD_SIZE``, else Lightning's devices per node); ``"nvlink"`` makes each
    NVLink island of the machine a "node" (:func:`kstep_layout`), so that per-step syncs
    stay on NVLink. When a merge is due is decided by a :class:`MergeSchedule`; a ``TieredEmbeddingBagCollection`` with
    ``sparse_sync="k_step"`` and no ``sync_every`` of its own merges its tables with the
    same ``k`` and warm-up. Logged (by :class:`KStepMonitor`, added to the Trainer when
    absent) every step: bytes sent inside and across nodes (``kstep/intra_node_bytes``,
    ``kstep/inter_node_bytes``, counted as ring collectives send them); at merges
    ``kstep/merge_ms`` and ``kstep/divergence`` (the ranks' mean relative L2 distance from
    the merged model). Registered as ``"kstep_adam"``: ``Trainer(strategy="kstep_adam")``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=4, num_nodes=2,
                          strategy=KStepAdamStrategy(k=16, mode="node", merge_optimizer_state=True))
    """

    def __init__(
        self,
        k: int = 16,
        mode: Mode = "all",
        merge_optimizer_state: bool = True,
        warmup_steps: int = 0,
        local_world_size: int | str | None = None,
        bucket_bytes: int = 25 << 20,
        overlap: bool = False,
        moment_dtype: MomentDtype = "bfloat16",
        find_unused_parameters: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_arguments: Any,
    ) -> None:
        # find_unused_parameters: either value is handled as DDP's True (see above); False
        # would only spare DDP a graph traversal this strategy never makes. DDPStrategy's
        # other arguments are listed, not passed through **kwargs, so that LightningCLI does
        # not offer (and fill in) the DDP wrapper's arguments, which are refused here.
        refuse_ddp_arguments(ddp_arguments)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.schedule = merge_schedule(k, warmup_steps)
        check_arguments(mode, local_world_size, bucket_bytes, moment_dtype)
        self.k = k
        self.mode = mode
        self.merge_optimizer_state = merge_optimizer_state
        self.warmup_steps = warmup_steps
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.moment_dtype = MOMENT_DTYPES[moment_dtype]
        self._local_world_size = local_world_size
        # Made in setup_environment(), once the process group exists.
        self.layout: NodeLayout | None = None
        self.average: HierarchicalAverage | None = None
        self.overlapped: OverlappedMerge | None = None
        self.checkpoint_merge: CheckpointMerge | None = None
        self.merging: ModelMerge | None = None
        self._metrics: list[tuple[int, dict[str, float]]] = []  # (step, metrics), for KStepMonitor

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("kstep_adam", cls, description="k-step model merging for Adam (KStepAdamStrategy)")

    # -- set-up ----------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # joins the process group
        self.layout = kstep_layout(self._local_world_size, self.world_size, self.global_rank, self.num_processes)
        intra, cross = self.layout.process_groups() if self.world_size > 1 else (None, None)
        self.average = HierarchicalAverage(self.layout, intra, cross, self.bucket_bytes)
        self.checkpoint_merge = CheckpointMerge(self.average, self.moment_dtype)
        if self.overlap and self.world_size > 1 and self.k > 1:
            # Groups of its own: its collectives run in another thread, beside the per-step ones.
            self.overlapped = OverlappedMerge(HierarchicalAverage(self.layout, *self.layout.process_groups(),
                                                                  self.bucket_bytes))
        self.merging = ModelMerge(self.average, self.moment_dtype, self.merge_optimizer_state, self.root_device,
                                  self.world_size, self.overlapped)

    @override
    def configure_ddp(self) -> None:
        # No DDP wrapper: gradients are averaged (or not) by this strategy, per mode and step.
        assert isinstance(self.model, pl.LightningModule)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        if self.mode == "node" and self.layout.num_nodes < 2:
            raise ValueError(
                f"KStepAdamStrategy: mode='node' merges across nodes, but the {self.world_size} ranks form one node "
                f"(local_world_size={self.layout.local_world_size}); use mode='all' or set local_world_size")
        for optimizer in self.optimizers:
            check_optimizer(optimizer, self.merge_optimizer_state)
        # Without DDP nobody else makes the replicas start equal.
        self._broadcast_start()
        for module in self.lightning_module.modules():
            follow = getattr(module, "follow_merge_schedule", None)  # sparse tables merging every k steps
            if follow is not None:
                follow(self.k, self.warmup_steps)
        if not any(isinstance(c, KStepMonitor) for c in trainer.callbacks):
            trainer.callbacks.append(KStepMonitor())
        rank_zero_info(f"KStepAdamStrategy: k={self.k}, mode={self.mode}, {self.layout.num_nodes} node(s) x "
                       f"{self.layout.local_world_size} rank(s), warm-up {self.warmup_steps} synchronous steps"
                       + (", merges overlapped with training" if self.overlapped else ""))

    def _broadcast_start(self) -> None:
        if self.world_size > 1:
            for tensor in self._module_tensors():
                dist.broadcast(tensor, src=0)

    def _module_tensors(self) -> list[torch.Tensor]:
        module = self.lightning_module
        return [p.data for p in module.parameters()] + [b for b in module.buffers() if b.is_floating_point()]

    @override
    def on_train_start(self) -> None:
        # A resumed run continues the k-step phase where the checkpoint left it.
        super().on_train_start()
        self.schedule.resume(self.lightning_module.trainer.global_step)

    # -- one step --------------------------------------------------------------------------

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        before = self.comm_bytes()
        synchronous = self.schedule.synchronous()
        self.checkpoint_merge.clear()  # the last checkpoint's copies: not kept past it

        def closure_then_average() -> Any:
            result = closure()
            if self.world_size > 1 and (synchronous or self.mode == "node"):
                average_gradients(optimizer, self.average, self.root_device, within_node_only=not synchronous)
            return result

        output = super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
        metrics: dict[str, float] = {}
        if self.schedule.step() and self.world_size > 1:
            metrics.update(self.merge_overlapped() if self.overlapped else self.merge())
        after = self.comm_bytes()  # an overlapped merge's bytes count where they are sent
        metrics["kstep/intra_node_bytes"] = float(after[0] - before[0])
        metrics["kstep/inter_node_bytes"] = float(after[1] - before[1])
        self._record(metrics)
        return output

    def comm_bytes(self) -> tuple[int, int]:
        """Bytes this rank has sent so far ``(inside its node, to other nodes)``, merges in
        flight included."""
        averages = [a for a in (self.average, self.overlapped and self.overlapped.average) if a is not None]
        return (sum(a.bytes.intra_node for a in averages), sum(a.bytes.inter_node for a in averages))

    @property
    def merges(self) -> int:
        """Merges applied so far."""
        return self.merging.merges if self.merging is not None else 0

    @property
    def last_divergence(self) -> float | None:
        """The ranks' mean relative L2 distance from the last merged model."""
        return self.merging.last_divergence if self.merging is not None else None

    def merge(self) -> dict[str, float]:
        """Average parameters (and Adam's moments) over all ranks; returns merge metrics."""
        return self.merging.merge(self.optimizers, self.lightning_module)

    def merge_overlapped(self) -> dict[str, float]:
        """Apply the merge in flight, then start the next one (see :meth:`ModelMerge.merge_overlapped`)."""
        return self.merging.merge_overlapped(self.optimizers, self.lightning_module)

    def _merge_pending(self) -> bool:
        """Whether the ranks took steps on their own since they were last equal."""
        return self.world_size > 1 and self.schedule.pending()

    def merge_local_steps(self) -> None:
        """Collective: merge now whatever the ranks stepped on their own since the last
        merge (an overlapped merge in flight is applied first), so they hold one model."""
        # Validation runs under inference mode; the merged tensors must stay normal ones.
        with torch.inference_mode(False), torch.no_grad():
            metrics = self.merging.apply_overlapped()
            if self._merge_pending():
                metrics.update(self.merge())
                self.schedule.note_merge()
        self._record(metrics)

    # -- checkpoints -------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state; between merges, the merged model's (see :class:`CheckpointMerge`).

        With ``overlap=True``, and when saving after an exception (the other ranks may not
        be saving), the checkpoint holds this rank's model.
        """
        state = super().lightning_module_state_dict()
        self.checkpoint_merge.clear()
        trainer = self.lightning_module.trainer
        if not self._merge_pending() or self.overlapped is not None or trainer.interrupted:
            return state
        moments = self.merging.agreed_moments(self.optimizers)  # not adopted: saving must not change training
        return self.checkpoint_merge.model_state(state, self.merging.tensors(self.optimizers, self.lightning_module,
                                                                             moments), moments)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.checkpoint_merge.optimizer_state(super().optimizer_state(optimizer), optimizer)

    @override
    def on_validation_start(self) -> None:
        # Validation (and the checkpoint that follows it) should see the model training
        # converges to, not each rank's local steps on its own shard of the data.
        super().on_validation_start()
        if self.lightning_module.trainer.state.fn == "fit":
            self.merge_local_steps()

    @override
    def on_train_end(self) -> None:
        # fit returns one model: the merge in flight is applied and the steps since merged.
        self.merge_local_steps()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self.overlapped is not None:
            self.overlapped.close()  # kept: its byte counts stay readable after fit
        super().teardown()

    # -- metrics -----------------------------------------------------------------------------

    def _record(self, metrics: dict[str, float]) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if metrics and trainer is not None:
            self._metrics.append((trainer.global_step, metrics))

    def pop_metrics(self) -> list[tuple[int, dict[str, float]]]:
        """``(step, metrics)`` recorded since the last call (read by :class:`KStepMonitor`)."""
        records, self._metrics = self._metrics, []
        return records

