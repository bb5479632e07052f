"""KStepAdamStrategy: every rank steps its own Adam; every k steps the models are merged."""

from __future__ import annotations

import inspect
import os
import time
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
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from ctr_lightning.merge_schedule import MergeSchedule
from ctr_lightning.node_layout import NodeLayout
from ctr_lightning.strategies.adam_moments import ParamMoments, adopt, agree_moments
from ctr_lightning.strategies.checkpoint_merge import CheckpointMerge
from ctr_lightning.strategies.hierarchical_average import HierarchicalAverage
from ctr_lightning.strategies.kstep_monitor import KStepMonitor
from ctr_lightning.strategies.merged_tensors import MergedTensors
from ctr_lightning.strategies.overlapped_merge import OverlappedMerge

Mode = Literal["all", "node"]
MomentDtype = Literal["bfloat16", "float32"]
_MOMENT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_DDP_COMM_HOOK_ARGUMENTS = frozenset({"ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"})


class KStepAdamStrategy(DDPStrategy):
    """k-step model merging for Adam (Baidu, arXiv 2201.05500), as a Lightning strategy.

    Every rank runs its own optimizer on its own batches. Every ``k`` optimizer steps the
    ranks average their parameters and, unless ``merge_optimizer_state=False``, Adam's
    ``exp_avg`` and ``exp_avg_sq`` (step counts stay equal: every rank takes every step).

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
    batches skip) are handled as DDP with ``find_unused_parameters=True`` handles them:
    every per-step average covers each parameter that any rank has a gradient for, a
    missing one counting as zero, and a parameter no rank has one for keeps none (Adam
    skips it). ``k=1`` then equals DDP step for step. Merges average every parameter,
    and Adam's moments of each parameter any rank has stepped, zeros where a rank has
    not (see :class:`ParamMoments`). ``find_unused_parameters`` is accepted and changes
    nothing; the arguments that configure DDP's model wrapper (``ddp_comm_hook``,
    ``model_averaging_period``, ``static_graph``...) are refused: there is no wrapper.
    Lightning's own periodic averaging (``DDPStrategy(model_averaging_period=k)``, post-local
    SGD) is not built on because it averages the parameters alone, leaving each rank's Adam
    moments apart, and on CPU Lightning never installs its hook.

    Parameters are averaged exactly, in float32. Adam's moments travel (and are summed)
    as ``moment_dtype``, bfloat16 by default, which cuts a merge from three model-sized
    messages to two. They are running statistics: each reduction hop rounds the running
    sum to bfloat16's 8 significant bits (2^-9 relative), so with a few ranks an averaged
    ``exp_avg_sq`` lands within about 0.4% of its float32 average (``exp_avg`` within
    that share of its inputs' magnitude, as opposite signs cancel), and the difference
    fades as the moments decay. bfloat16 keeps float32's exponent range, so small
    ``exp_avg_sq`` do not flush to zero as they would in float16.
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
    NVLink island of the machine a "node" (read by ``ctr_lightning.topology``; the whole
    node where the islands are unknown, unequal or single GPUs), so that per-step syncs
    stay on NVLink. When a merge is due is
    decided by a :class:`MergeSchedule`; a ``TieredEmbeddingBagCollection`` with
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
        _refuse_ddp_arguments(ddp_arguments)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        try:
            self.schedule = MergeSchedule(k=k, warmup_steps=warmup_steps)
        except ValueError as e:
            raise ValueError(f"KStepAdamStrategy: {e}") from None
        if mode not in ("all", "node"):
            raise ValueError(f"KStepAdamStrategy: mode must be 'all' or 'node', got {mode!r}")
        if isinstance(local_world_size, str) and local_world_size != "nvlink":
            raise ValueError(f"KStepAdamStrategy: local_world_size must be an int, 'nvlink' or None, "
                             f"got {local_world_size!r}")
        if bucket_bytes < 1:
            raise ValueError(f"KStepAdamStrategy: bucket_bytes must be >= 1, got {bucket_bytes}")
        if moment_dtype not in _MOMENT_DTYPES:
            raise ValueError(f"KStepAdamStrategy: moment_dtype must be one of {sorted(_MOMENT_DTYPES)} (float16 "
                             f"would flush small exp_avg_sq to zero), got {moment_dtype!r}")
        self.k = k
        self.mode = mode
        self.merge_optimizer_state = merge_optimizer_state
        self.warmup_steps = warmup_steps
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.moment_dtype = _MOMENT_DTYPES[moment_dtype]
        self._local_world_size = local_world_size
        # Made in setup_environment(), once the process group exists.
        self.layout: NodeLayout | None = None
        self.average: HierarchicalAverage | None = None
        self.overlapped: OverlappedMerge | None = None
        self.checkpoint_merge: CheckpointMerge | None = None
        self.merges = 0
        self.last_divergence: float | None = None
        self._metrics: list[tuple[int, dict[str, float]]] = []  # (step, metrics), for KStepMonitor

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("kstep_adam", cls, description="k-step model merging for Adam (KStepAdamStrategy)")

    # -- set-up ----------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # joins the process group
        local = self._local_world_size
        if local == "nvlink":  # a "node" of the merge is an NVLink island: rank 0's reading, for all
            from ctr_lightning.topology import discover
            from ctr_lightning.topology.planner import nvlink_group_size

            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.num_processes))
            found = [nvlink_group_size(discover(), per_node) if self.global_rank == 0 else None]
            if self.world_size > 1:
                dist.broadcast_object_list(found, src=0)
            local = found[0]
        if local is None and "LOCAL_WORLD_SIZE" not in os.environ:
            local = self.num_processes  # Lightning's devices per node
        self.layout = NodeLayout.of(self.world_size, self.global_rank, local)
        intra, cross = self.layout.process_groups() if self.world_size > 1 else (None, None)
        self.average = HierarchicalAverage(self.layout, intra, cross, self.bucket_bytes)
        self.checkpoint_merge = CheckpointMerge(self.average, self.moment_dtype)
        if self.overlap and self.world_size > 1 and self.k > 1:
            # Groups of its own: its collectives run in another thread, beside the per-step ones.
            self.overlapped = OverlappedMerge(HierarchicalAverage(self.layout, *self.layout.process_groups(),
                                                                  self.bucket_bytes))

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
            self._check_optimizer(optimizer)
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

    def _check_optimizer(self, optimizer: Optimizer) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if self.merge_optimizer_state and not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(
                f"KStepAdamStrategy: merge_optimizer_state=True merges Adam's exp_avg and exp_avg_sq, but the "
                f"optimizer is {type(inner).__name__}; use Adam/AdamW or merge_optimizer_state=False")

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
                self._average_gradients(optimizer, within_node_only=not synchronous)
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

    def _average_gradients(self, optimizer: Optimizer, within_node_only: bool) -> None:
        """Average the gradients of ``optimizer``'s parameters as DDP with
        ``find_unused_parameters=True`` does: the ranks first agree which parameters have
        one anywhere; those are averaged in parameter order, a missing one counting as
        zero; the others keep none, so Adam skips them on every rank."""
        if within_node_only and self.layout.local_world_size == 1:
            return  # a node of one rank: nothing to average with
        params = [p for group in optimizer.param_groups for p in group["params"]]
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.root_device)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.average.intra if within_node_only else None)
        grads = []
        for p, anywhere in zip(params, present.tolist()):
            if anywhere:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        self.average(grads, within_node_only=within_node_only)

    def comm_bytes(self) -> tuple[int, int]:
        """Bytes this rank has sent so far ``(inside its node, to other nodes)``, merges in
        flight included."""
        averages = [a for a in (self.average, self.overlapped and self.overlapped.average) if a is not None]
        return (sum(a.bytes.intra_node for a in averages), sum(a.bytes.inter_node for a in averages))

    def _agreed_moments(self) -> list[ParamMoments]:
        """Adam's state of every parameter any rank has stepped, alike on every rank
        (collective); none without ``merge_optimizer_state``."""
        if not self.merge_optimizer_state:
            return []
        return agree_moments(self.optimizers, self.root_device, self.world_size)

    def _merged_tensors(self, moments: list[ParamMoments]) -> MergedTensors:
        """The whole model: every optimizer's parameters (and ``moments``), so that a merge
        leaves the ranks equal whichever optimizer stepped last."""
        # In parameter order, the same on every rank (a state dict's order is not).
        params = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]]
        exact = [p.data for p in params] + [b for b in self.lightning_module.buffers() if b.is_floating_point()]
        named = [(name, t) for m in moments for name, t in m.moments.items()]
        return MergedTensors(params, exact, [t for _, t in named], [name == "exp_avg_sq" for name, _ in named],
                             self.moment_dtype)

    def _merged_tensors_adopted(self) -> MergedTensors:
        """The whole model for a merge of the live tensors: each optimizer first holds the
        agreed Adam state (zero moments where it had none), which the merge then averages."""
        moments = self._agreed_moments()
        adopt(moments)
        return self._merged_tensors(moments)

    def merge(self) -> dict[str, float]:
        """Average parameters (and Adam's moments) over all ranks; returns merge metrics."""
        start = time.perf_counter()
        merged_tensors = self._merged_tensors_adopted()
        local = [p.detach().clone() for p in merged_tensors.params]
        merged_tensors.average_with(self.average)
        divergence = merged_tensors.distance_from(local)
        dist.all_reduce(divergence)
        self.last_divergence = float(divergence) / self.world_size
        self.merges += 1
        return {"kstep/merge_ms": (time.perf_counter() - start) * 1000.0, "kstep/divergence": self.last_divergence}

    def merge_overlapped(self) -> dict[str, float]:
        """Apply the merge in flight, then start the next one; ``kstep/merge_ms`` is the
        time training stood still for it (waiting, correcting, snapshotting)."""
        start = time.perf_counter()
        metrics = self._apply_overlapped()
        self.overlapped.launch(self._merged_tensors_adopted())
        metrics["kstep/merge_ms"] = (time.perf_counter() - start) * 1000.0
        return metrics

    def _apply_overlapped(self) -> dict[str, float]:
        applied = self.overlapped.apply() if self.overlapped is not None else None
        if applied is None:
            return {}
        self.last_divergence, waited = applied
        self.merges += 1
        return {"kstep/divergence": self.last_divergence, "kstep/merge_wait_ms": waited}

    def _merge_pending(self) -> bool:
        """Whether the ranks took steps on their own since they were last equal."""
        return self.world_size > 1 and self.schedule.pending()

    def merge_local_steps(self) -> None:
        """Collective: merge now whatever the ranks stepped on their own since the last
        merge (an overlapped merge in flight is applied first), so they hold one model."""
        # Validation runs under inference mode; the merged tensors must stay normal ones.
        with torch.inference_mode(False), torch.no_grad():
            metrics = self._apply_overlapped()
            if self._merge_pending():
                metrics.update(self.merge())
                self.schedule.merged()
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
        moments = self._agreed_moments()  # not adopted: saving must not change training
        return self.checkpoint_merge.model_state(state, self._merged_tensors(moments), moments)

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


def _refuse_ddp_arguments(arguments: dict[str, Any]) -> None:
    """Refuse the arguments DDPStrategy hands to its DistributedDataParallel wrapper (or
    uses on it): without a wrapper they would be silently ignored."""
    wrapper_arguments = inspect.signature(DistributedDataParallel.__init__).parameters
    refused, unknown = [], []
    for name in sorted(arguments):
        if name in _DDP_COMM_HOOK_ARGUMENTS:
            refused.append(f"{name} (a DDP communication hook: this strategy averages gradients itself, every step "
                           f"only with k=1, in warm-up, or inside a node with mode='node')")
        elif name == "model_averaging_period":
            refused.append(f"{name} (DDP's post-local-SGD model averaging: this strategy merges the models every k "
                           f"steps; set k)")
        elif name in wrapper_arguments:
            refused.append(f"{name} (an argument of DistributedDataParallel, which this strategy does not wrap the "
                           f"model in)")
        else:
            unknown.append(name)
    if unknown:
        raise TypeError(f"KStepAdamStrategy got unexpected keyword arguments: {', '.join(unknown)}")
    if refused:
        raise ValueError(f"KStepAdamStrategy has no DDP wrapper, so it does not take {'; '.join(refused)}")
