"""TieredEmbeddingBagCollection: pooled embeddings whose rows live in HBM, DRAM and SSD."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ctr_lightning.embedding.admission_config import Admission
from ctr_lightning.embedding.expiry_config import Expiry
from ctr_lightning.embedding.lifecycle.lifecycle_state import LifecycleState
from ctr_lightning.embedding.collection_copies import claim_planned_ssd, refuse_copy
from ctr_lightning.embedding.engine import TableEngine
from ctr_lightning.embedding.local_tables import LocalTables
from ctr_lightning.embedding.loss_scaling import unscale_in_backward, warn_if_loss_may_be_scaled
from ctr_lightning.embedding.optimizers import SparseAdam, SparseOptimizer
from ctr_lightning.embedding.sharding_plan import SHARDING_KINDS, TableSharding, plan_sharding
from ctr_lightning.embedding.snapshots.collection_snapshots import CollectionSnapshots
from ctr_lightning.embedding.snapshots.table_snapshot import SnapshotManifest
from ctr_lightning.embedding.storage_config import AutoStorage, StorageConfig
from ctr_lightning.embedding.table_checks import check_tables, torchrec_input
from ctr_lightning.embedding.table_placer import PlacedTables, TablePlacer
from ctr_lightning.embedding.table_setup import TableSetup, check_kernel_device
from ctr_lightning.embedding.torchrec_state import rows_from_torchrec, torchrec_weights
from ctr_lightning.fault_points import reached
from ctr_lightning.merge_schedule import MergeSchedule

DEFAULT_SYNC_EVERY = 16


class GatheringSsdRowsError(RuntimeError):
    """A state dict would gather into memory the rows an SSD tier holds (tables meant to be
    larger than memory), and nobody asked for that: checkpoints of such tables go to table
    snapshots, or whole rows are asked for with ``checkpoint_to_snapshots(None)``."""


class TieredEmbeddingBagCollection(nn.Module):
    """A drop-in for torchrec's ``EmbeddingBagCollection`` for tables larger than RAM.

    Rows live in up to three tiers (see :class:`StorageConfig`): the device tier the
    compute reads, a DRAM cache, and files on SSD holding every row that left memory.
    Any 64-bit id is its own row (a key index, no hashing into ``num_embeddings``)
    unless the table's ids are declared ``"bounded"``. A row nobody trained is stored
    nowhere: its initial value is a function of (seed, table, id).

    The sparse optimizer runs inside backward on the touched rows only, with its state
    stored beside each row in every tier; give Lightning's optimizer only the other
    parameters (this module has none).

    Args:
        tables: the tables, as torchrec configs (SUM or MEAN pooling).
        storage: one :class:`StorageConfig` for all tables, or one per table name; or ``"auto"``
            (an :class:`AutoStorage`): budgets planned from the machine by a ``placer``
            (:meth:`plan_placement`). Default: everything in the device tier.
        optimizer: :class:`SparseAdam` (default), ``SparseAdagrad``, ``RowWiseAdagrad``, ``SparseSGD``.
        id_space: ``"hashed"`` (any non-negative id) or ``"bounded"`` (``0 <= id <
            num_embeddings``), for all tables or per table name.
        is_weighted: whether the KJT carries per-id weights.
        device: where the device tier lives (CPU memory or a CUDA device).
        seed: initial values.
        kernel: ``"numba"`` (fused CPU kernels, the default on CPU), ``"torch"`` (generic
            torch ops, the default on CUDA), or ``"auto"``.
        sharding: under torch.distributed with more than one rank, how tables are split:
            ``"row_wise"`` (by a hash of the id), ``"table_wise"``, ``"data_parallel"`` (a
            replica on every rank: for small hot tables), ``"auto"`` (see
            :func:`plan_sharding`; under ``storage="auto"``, the planner's cost model picks
            per table), or a dict table name -> kind. Each rank passes its own
            batch; ids travel to their owners and pooled rows back (torchrec all-to-alls);
            a data-parallel table is looked up in this rank's replica, and the ranks
            all-gather its row gradients, so every replica applies the same update.
            Each rank's SSD files go into ``<ssd_dir>/rank<r>``.
        process_group: the ranks to shard over; default all, in a group of their own.
        sparse_sync: when sharded, ``"step"`` (ids and pooled rows travel every step) or
            ``"k_step"``: each rank trains a local copy of the rows its batches touch
            (pulling rows it lacks from their owners) and every ``sync_every`` training
            steps pushes the deltas to the owners, who average them over the ranks that
            touched each row (see :class:`KStepTables`).
        sync_every: k of ``sparse_sync="k_step"``; default: the ``k`` (and warm-up) of a
            :class:`KStepAdamStrategy` training the module, else 16.
        sync_state_dtype: how the optimizer state (Adam's moments, Adagrad's sums) of rows
            travels under ``sparse_sync="k_step"``: ``"bfloat16"`` (the default, as the dense
            k-step merge does; a third less on the wire at Adam) or ``"float32"`` (exact).
            Weights and their deltas always travel in float32.
        placer: under ``storage="auto"``, the :class:`TablePlacer` that plans the tiers
            (``ctr_lightning.topology.place_tables``): given here, the first use plans with a
            guess of the access (Zipf) and a batch of 4096, unless :meth:`plan_placement` came
            first. Without one the tiers cannot be built until :meth:`plan_placement` gets one;
            under Lightning the :class:`~ctr_lightning.callbacks.AutoPlacement` callback does
            that at the start of fit (a CTRModule adds it by itself).
        admission: which new ids get a row (:class:`Admission`: after N sightings, or with
            a probability), for all tables or per table name (tables left out admit every
            id). An id not admitted reads zeros and is not updated; under ``sparse_sync="k_step"``
            the owners admit at each merge on the interval's sightings of all ranks. Not on
            data-parallel tables.
        expiry: which stored rows go (:class:`Expiry`: not looked up in ``ttl`` training
            steps, or the least recent above ``max_rows``), for all tables or per table
            name. A row gone reads as one stored nowhere. Tables of hashed ids only; not on
            data-parallel tables; under ``sparse_sync="k_step"`` the owners decide at each
            merge (in data time, on every step's newest event time over the ranks).

    Example::

        ebc = TieredEmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t0", embedding_dim=64, num_embeddings=10**9,
                                       feature_names=["f0"])],
            storage=StorageConfig(device_rows=100_000, host_bytes=2 << 30, ssd_dir="/nvme/run1"),
            optimizer=SparseAdam(lr=1e-3))
        kt = ebc(kjt)             # KeyedTensor, as torchrec's EmbeddingBagCollection
        ebc.rows("t0", ids)       # current weights, without side effects
        # Under torch.distributed (world size > 1) the same code shards the tables over ranks.

        # storage="auto" without Lightning: plan with the data's batch size before the first use.
        from ctr_lightning.topology import place_tables
        ebc = TieredEmbeddingBagCollection(tables, storage="auto")
        ebc.plan_placement(batch_size=4096, placer=place_tables)
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        storage: StorageConfig | Mapping[str, StorageConfig] | AutoStorage | str | None = None,
        optimizer: SparseOptimizer = SparseAdam(),
        id_space: str | Mapping[str, str] = "hashed",
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        seed: int = 0,
        kernel: str = "auto",
        sharding: str | Mapping[str, str] = "row_wise",
        process_group: dist.ProcessGroup | None = None,
        sparse_sync: str = "step",
        sync_every: int | None = None,
        sync_state_dtype: str = "bfloat16",
        placer: TablePlacer | None = None,
        admission: Admission | Mapping[str, Admission | None] | None = None,
        expiry: Expiry | Mapping[str, Expiry | None] | None = None,
    ) -> None:
        super().__init__()
        self._feature_names = check_tables(tables, type(self).__name__)
        if storage == "auto":
            storage = AutoStorage()
        elif isinstance(storage, str):
            raise ValueError(f"storage must be a StorageConfig, a dict of them, 'auto' or AutoStorage, got {storage!r}")
        # storage auto: the tiers are planned when the collection is built, on the rank that
        # holds them; until then it is set up with every row in memory.
        self._auto_storage = storage if isinstance(storage, AutoStorage) else None
        if placer is not None and self._auto_storage is None:
            raise ValueError(f"{type(self).__name__}: placer is for storage 'auto' (it plans the tiers); the storage "
                             f"given is set by hand")
        self._placer = placer
        self._placement_inputs: tuple[int, Mapping[str, Any] | None] = (4096, None)  # batch size, access
        self.placement: PlacedTables | None = None
        self._setup = TableSetup.build(tables, None if self._auto_storage else storage, optimizer, id_space,
                                       is_weighted, device, seed, kernel, module_name=type(self).__name__,
                                       admission=admission, expiry=expiry)
        if isinstance(sharding, str) and sharding not in (*SHARDING_KINDS, "auto"):
            raise ValueError(f"sharding must be one of {list(SHARDING_KINDS)}, 'auto' or a dict, got {sharding!r}")
        if sparse_sync not in ("step", "k_step"):
            raise ValueError(f"sparse_sync must be 'step' or 'k_step', got {sparse_sync!r}")
        if sync_every is not None and sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if sync_state_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"sync_state_dtype must be 'bfloat16' or 'float32', got {sync_state_dtype!r}")
        self._tables = list(tables)
        self._is_weighted = is_weighted
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self._sharding = sharding
        self._process_group = process_group
        self._sparse_sync = sparse_sync
        self._sync_every = sync_every
        self._sync_state_dtype = getattr(torch, sync_state_dtype)
        self._merge_schedule = MergeSchedule(k=sync_every or DEFAULT_SYNC_EVERY)
        # Built on first use: only then is it known whether torch.distributed runs, and
        # the collection shards itself over the ranks (Lightning starts them after the
        # model is made).
        self._engine: TableEngine | None = None
        self._snapshots = CollectionSnapshots()
        # Where a checkpoint's snapshot is looked for by name when its recorded path is
        # gone (the run directory moved): asked when a checkpoint is loaded, since only then
        # is it known which checkpoint that is. TableSnapshots sets it.
        self.snapshot_search: Callable[[], list[Path]] = list
        # Under storage auto, rows a checkpoint restores before the collection is built wait
        # here: Lightning restores the module before the strategy moves it to its device and
        # before fit starts, and planning then would size the tiers for the wrong device.
        # ("tables", per-table state) or ("snapshot", path, reference): data, so a copy of the module carries it.
        self._pending_load: tuple | None = None
        self._lifecycle = LifecycleState(self._setup)  # admission's counters and expiry's floors, as the rows
        # Set when this collection or one it was copied from was copied before storage auto
        # planned its tiers: the copies' common key (see __getstate__, collection_copies).
        self._copy_lineage: str | None = None

    def follow_merge_schedule(self, k: int, warmup_steps: int = 0) -> None:
        """Merge the local copies of ``sparse_sync="k_step"`` with a k-step strategy's ``k`` and
        warm-up, unless ``sync_every`` was given. :class:`KStepAdamStrategy` calls this at
        set-up, so a user sets k once."""
        if self._sync_every is None:
            MergeSchedule(k=k, warmup_steps=warmup_steps)  # checks them
            # In place: a k-step engine already built holds this very schedule.
            self._merge_schedule.k, self._merge_schedule.warmup_steps = k, warmup_steps

    def _built(self) -> TableEngine:
        if self._engine is not None:
            self._restore_pending()  # one that failed before: raise again rather than train on initial rows
            return self._engine
        process_group = self._process_group
        if (process_group is None and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            # Its own group, so the all-to-alls never interleave with DDP's all-reduces.
            process_group = dist.new_group()
        if process_group is not None and process_group.size() > 1:
            from ctr_lightning.embedding.distributed import KStepTables, ShardedTables

            plan = self._place(process_group)
            if self._sparse_sync == "k_step":
                self._engine = KStepTables(self._tables, self._setup, plan, process_group, self._merge_schedule,
                                                state_dtype=self._sync_state_dtype)
            else:
                self._engine = ShardedTables(self._tables, self._setup, plan, process_group)
        else:
            self._place(None)
            self._engine = LocalTables(self._tables, self._setup)
        self._restore_pending()
        return self._engine

    def _restore_pending(self) -> None:
        """Load the rows a checkpoint restored before the collection was built. If that
        fails, the load stays pending, so the next use raises again instead of training on
        initial rows."""
        pending, self._pending_load = self._pending_load, None
        try:
            if pending is not None and pending[0] == "snapshot":
                self._snapshots.load(self._engine, pending[1], pending[2])
            elif pending is not None:
                self._engine.load(pending[1])
        except BaseException:
            self._pending_load = pending
            raise
        self._lifecycle.restore(self._engine)

    def table_tiers(self) -> dict[str, dict[str, Any]]:
        """Per table, the tiers it is set up with: ``device_rows`` and ``host_rows`` (the
        tiers' capacities in rows; None: every row the table gets), ``ssd_dir`` (None: no
        SSD tier) and ``row_bytes`` (a row with its optimizer state). Under storage auto, the
        planned tiers once planned (:meth:`plan_placement`); before that an error.

        Example::

            ebc.table_tiers()["user"]   # {"device_rows": 100000, "host_rows": 0, "ssd_dir": "/nvme/r", ...}
        """
        if self._auto_storage is not None and self.placement is None:
            raise RuntimeError(f"{type(self).__name__}: storage 'auto' is planned at the start of fit "
                               f"(plan_placement); its tiers are not known yet")
        return self._setup.tiers(self._tables)

    @property
    def auto_storage(self) -> AutoStorage | None:
        """The :class:`AutoStorage` the tiers are planned with, or None (set by hand)."""
        return self._auto_storage

    def plan_placement(self, batch_size: int = 4096, access: Mapping[str, Any] | None = None,
                       placer: TablePlacer | None = None) -> PlacedTables | None:
        """Under ``storage="auto"``, plan this rank's tiers now (collective across ranks) with
        ``placer`` (else the one given to the constructor), the data's ``batch_size`` per rank
        and measured ``access`` profiles (``ctr_lightning.topology.measure_access``); returns
        the placer's answer, which :attr:`placement` keeps. None without storage auto; once
        planned, the plan made then. The :class:`~ctr_lightning.callbacks.AutoPlacement`
        callback calls it at the start of fit."""
        if self._auto_storage is None or self._engine is not None:
            return self.placement
        if placer is not None:
            self._placer = placer
        self._placement_inputs = (batch_size, access)
        self._built()
        return self.placement

    def _place(self, process_group: dist.ProcessGroup | None) -> dict[str, TableSharding]:
        """The tables' sharding over ``process_group``; under ``storage="auto"`` also this
        rank's tiers, planned (and ``sharding="auto"`` chosen by the planner's cost model)."""
        world = process_group.size() if process_group is not None else 1
        if self._auto_storage is None:
            return plan_sharding(self._tables, world, self._sharding)
        if self._placer is None:
            raise RuntimeError(
                f"{type(self).__name__} of tables {[t.name for t in self._tables]}: storage 'auto' has no placer to "
                f"plan its tiers with. Pass one: TieredEmbeddingBagCollection(..., storage='auto', "
                f"placer=ctr_lightning.topology.place_tables), or call plan_placement(batch_size, "
                f"placer=ctr_lightning.topology.place_tables) before the first use; under Lightning add "
                f"ctr_lightning.callbacks.AutoPlacement() to the Trainer's callbacks (a CTRModule adds it by itself)")
        batch_size, access = self._placement_inputs
        self.placement = self._placer(self._tables, optimizer=self._setup.optimizer, sharding=self._sharding,
                                      auto=self._auto_storage, device=self._setup.device,
                                      process_group=process_group, batch_size=batch_size, access=access,
                                      sparse_sync=self._sparse_sync,
                                      k=self._merge_schedule.k if self._sparse_sync == "k_step" else 1)
        self._setup = self._setup.with_storage(self._tables, self.placement.storage)
        if self._copy_lineage is not None:
            claim_planned_ssd(self._copy_lineage, self._ssd_dirs(), self, type(self).__name__,
                              [t.name for t in self._tables])
        return dict(self.placement.sharding_plan)

    @property
    def device(self) -> torch.device:
        """Where the device tier lives; it follows ``module.to(device)``."""
        return self._setup.device

    @property
    def ssd_directories(self) -> list[str]:
        """The SSD tier's directories (each rank of a sharded collection uses ``<dir>/rank<r>``)."""
        if self._auto_storage is not None:
            self._built()  # under storage auto, where the SSD tier goes is planned then
        return self._ssd_dirs()

    def _ssd_dirs(self) -> list[str]:
        """The SSD directories set up now (under storage auto, none before the plan)."""
        return sorted({s.ssd_dir for s in self._setup.storage.values() if s.ssd_dir is not None})

    @property
    def sharding_plan(self) -> dict[str, TableSharding] | None:
        """Per table, how it is split over ranks; None when the collection is not sharded."""
        return self._built().sharding_plan

    # -- torchrec's interface ----------------------------------------------------------------

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._tables

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        device = features.values().device
        if self._setup.device.type == "cpu" and device.type != "cpu":
            # Else the CPU kernels fail deep inside on a tensor they cannot read.
            raise ValueError(f"{type(self).__name__}: tables {[t.name for t in self._tables]} are in cpu memory but "
                             f"the KJT is on {device}; move the module first (.to({str(device)!r}), as Lightning does)")
        features = torchrec_input(features, self._feature_names, self._tables, self._is_weighted, type(self).__name__)
        engine = self._built()  # first: a restore waiting there counts a version of its own, before this step's
        train = self.training and torch.is_grad_enabled()
        if train:
            self._snapshots.rows_changed()
            # Every step: the engine may have been built after set_grad_scaler.
            engine.skip_nonfinite_updates(self._grad_scaler is not None)
        pooled = engine.forward(features, train)
        if train:
            if self._grad_scaler is not None:
                unscale_in_backward(pooled, self._grad_scaler)
            else:
                warn_if_loss_may_be_scaled(device, type(self).__name__)
            reached("train_step")
        return KeyedTensor(keys=self._feature_names, length_per_key=self._dims, values=pooled)

    # The scaler of the loss (set_grad_scaler); None: gradients arrive unscaled.
    _grad_scaler: torch.amp.GradScaler | None = None

    def set_grad_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Train under the loss-scaling ``torch.amp.GradScaler`` that scales the loss
        (float16 mixed precision); ``None``: the loss is not scaled.

        The sparse optimizer runs inside backward, before the scaler sees any gradient. So
        the tables divide their gradient by the scaler's scale, and a step whose gradient
        reaching the tables overflowed updates no row, optimizer state or step count, as
        ``scaler.step`` then skips the dense optimizer: all tables alike (on every rank,
        when sharded). An overflow confined to dense layers the tables do not feed (a
        bottom MLP) makes the scaler skip the dense step alone; the rows then take their
        step, on a finite, unscaled gradient. Costs a CPU-GPU sync per backward on CUDA.
        Under Lightning's ``precision="16-mixed"`` hand it ``trainer.precision_plugin.scaler``
        (in ``on_fit_start``).

        Example::

            scaler = torch.amp.GradScaler("cuda")
            ebc.set_grad_scaler(scaler)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(batch)
            scaler.scale(loss).backward()   # the rows are updated here, unscaled
            scaler.step(optimizer)
            scaler.update()
        """
        self._grad_scaler = scaler

    def _apply(self, fn: Any, recurse: bool = True) -> TieredEmbeddingBagCollection:
        # .to(device) / .cuda() (Lightning calls them) move the device tier with the module.
        super()._apply(fn, recurse)
        # Probed on the current device: a dtype-only conversion (.float(), .to(torch.bfloat16))
        # must leave the tier where it is.
        device = fn(torch.empty(0, device=self._setup.device)).device
        if device != self._setup.device:
            check_kernel_device(self._setup.kernel, device)
            self._setup = dataclasses.replace(self._setup, device=device)
            if self._engine is not None:
                self._engine.move_device_tier(device)
        return self

    # -- inspection ----------------------------------------------------------------------

    def rows(self, table: str, ids: torch.Tensor | np.ndarray | Sequence[int]) -> torch.Tensor:
        """Current weights ``[len(ids), dim]`` of rows of ``table``; reads only, stores nothing.

        When sharded, this is collective: every rank passes the same ids.
        """
        if table not in self._setup.storage:
            raise KeyError(f"no table {table!r}; tables are {[t.name for t in self._tables]}")
        ids = torch.as_tensor(np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64))
        return self._built().rows(table, ids)

    def tier_stats(self) -> dict[str, int]:
        """Cumulative counts (this rank): rows served by each tier, rows first created, rows
        served from what the prefetcher read ahead, rows and bytes it read; and microseconds:
        waiting on SSD reads (``ssd_stall_us``), making room in the device tier
        (``evict_us``), and within that the SSD tier's writing, cleaning and index growth
        (``ssd_write_us``, ``ssd_clean_us``, ``index_grow_us``)."""
        return self._built().counters()

    @property
    def delta_tables(self) -> set[str]:
        """Tables delta exports for serving can follow: their rows record their last lookup
        step (an :class:`Expiry`; a table kept by a score also ranks them by its score's
        bucket, which the export writes per row)."""
        return set(self._setup.expiry)

    def observe_labels(self, labels: torch.Tensor) -> None:
        """The labels of the training batch about to run, for tables whose :class:`Expiry`
        score counts clicks (``score="show_click"``; CTRModule calls it; nothing happens
        where none does). Call it before each training forward."""
        if self._setup.click_tables:
            self._built().observe_labels(labels.detach().cpu().numpy().astype(np.float64))

    def observe_event_time(self, seconds: float | None) -> None:
        """The newest event time (POSIX seconds) of the training batch about to run, for
        tables whose :class:`Expiry` ttl counts in data time (CTRModule calls it with each
        ``Batch.event_time``; nothing happens where no ttl does; None: this rank's batch has
        none). Call it before each training forward; collective when sharded (the newest over
        all ranks counts, so every rank calls it).

        Example::

            ebc.observe_event_time(float(batch.event_time.max()))
            loss = model(batch); loss.backward()
        """
        self._built().observe_event_time(seconds)

    def expiry_counts(self) -> dict[str, dict[str, int]]:
        """Per table that expires rows (``expiry``), this rank's ``rows`` live now and the rows
        gone so far: ``expired`` (by ttl) and ``evicted`` (by max_rows)."""
        return self._built().expiry_counts()

    def admission_counts(self) -> dict[str, dict[str, int]]:
        """Per table that admits ids selectively (``admission``), the rows this rank
        ``admitted`` and ``rejected`` so far (each owner counts its own rows); where it
        counts sightings, also its sketch's ``counters`` and ``counters_used`` (not zero)
        on this rank."""
        return self._built().admission_counts()

    def storage_stats(self) -> dict[str, int]:
        """What this rank's tiers hold now: ``ssd_rows``, ``ssd_bytes`` (the files on disk),
        ``ssd_live_bytes``, ``ssd_index_bytes``, ``memory_rows`` and ``dram_bytes`` (memory
        tiers, with their bookkeeping, and the SSD index)."""
        return self._built().storage()

    def comm_bytes(self) -> int:
        """Bytes this rank has sent to other ranks in the sharded all-to-alls (0 unsharded)."""
        return self._built().comm_bytes()

    # -- working-set prefetch (driven by WorkingSetPrefetcher) -----------------------------

    def register_upcoming(self, features: KeyedJaggedTensor, batch: int) -> list[Callable[[], None]]:
        """Note the rows upcoming ``batch`` (numbered in increasing order) will touch, and
        return the reads that bring in those on SSD: callables for a background thread.

        When sharded this is collective (the ids travel to their owners, who note and
        read their rows), so every rank registers its batches in the same order.
        """
        features = torchrec_input(features, self._feature_names, self._tables, self._is_weighted, type(self).__name__)
        return self._built().register_upcoming(features, batch)

    def release_upcoming(self, batch: int) -> None:
        """``batch`` has run: forget what was read ahead for it."""
        self._built().release_upcoming(batch)

    def stop_prefetch(self) -> None:
        self._built().stop_prefetch()

    # -- checkpoints ---------------------------------------------------------------------

    def save_tables(self, directory: str | os.PathLike, incremental: bool = False,
                    link_segments: bool = True) -> SnapshotManifest:
        """Write every row to a new snapshot in ``directory``, streaming from every tier (one
        chunk of rows in memory, not the table); the manifest, written last, completes it.

        With ``incremental``, only the rows changed since the last snapshot this collection
        saved or loaded are written, and the new snapshot names that one as its parent
        (loading reads the chain), when that one lies in the same folder: a chain never
        spans two folders, so a run resumed from another run's checkpoint does not depend
        on that run's files. Every ``full_every``-th save of a chain (see
        :meth:`checkpoint_to_snapshots`) writes all rows again, so chains stay short.
        ``link_segments``: share sealed SSD segments by hard link where the file system
        allows (little is written, but one damaged segment damages every snapshot linking
        it), or ``False``: copy their rows. When sharded this is collective: each rank
        writes the rows it owns to its own files, and ``directory`` must be one every rank sees."""
        return self._snapshots.save(self._built(), directory, incremental, link_segments)

    def load_tables(self, directory: str | os.PathLike) -> SnapshotManifest:
        """Replace every row by a snapshot's (checked against its manifest's checksums
        first; an incremental one with its ancestors), streaming; the snapshot may come from
        any number of ranks and sharding, and the storage budgets may differ from the
        saving run's. Each rank keeps the rows it owns; not collective."""
        if self._engine is None:
            self._pending_load = None  # these rows replace any a checkpoint left waiting
        return self._snapshots.load(self._built(), directory)

    def checkpoint_to_snapshots(self, root: str | os.PathLike | None, full_every: int = 8,
                                link_segments: bool = True) -> None:
        """From now on the state dict (and so a Lightning checkpoint) holds a reference to a
        new table snapshot under ``root`` instead of the rows: saving streams the rows, at
        the memory of one chunk, each rank its own, and only those changed since the
        previous snapshot, except every ``full_every``-th (1: every save is full);
        ``link_segments`` as in :meth:`save_tables`. ``None``: every row in the state dict,
        asked for: a collection with an SSD tier is then no longer switched to snapshots by
        default (:attr:`gathers_ssd_rows`). The :class:`~ctr_lightning.callbacks.TableSnapshots`
        callback sets this up."""
        self._snapshots.checkpoint_to(root, full_every, link_segments)

    @property
    def gathers_ssd_rows(self) -> bool:
        """Whether a state dict (so a Lightning checkpoint) would gather into memory rows an
        SSD tier holds: the tables may keep rows on SSD (an SSD directory, or storage auto
        before its plan), checkpoints do not go to table snapshots, and whole rows were not
        asked for. :class:`~ctr_lightning.models.CTRModule` then adds a
        :class:`~ctr_lightning.callbacks.TableSnapshots` to a trainer that checkpoints."""
        if self._snapshots.root is not None or self._snapshots.whole_rows_asked:
            return False
        if self._auto_storage is not None and self._engine is None:
            return True  # not planned yet (planning here would size the tiers for the wrong device)
        return bool(self._ssd_dirs())

    def current_snapshot(self) -> Path | None:
        """The snapshot the state dict refers to now, if one was written for these rows."""
        return self._snapshots.current()

    @property
    def snapshots_written(self) -> list[Path]:
        """The snapshots this process wrote for checkpoints: :class:`TableSnapshots` may delete them."""
        return self._snapshots.written

    @snapshots_written.setter
    def snapshots_written(self, snapshots: list[Path]) -> None:
        self._snapshots.written = snapshots

    def get_extra_state(self) -> dict[str, Any]:
        if self._snapshots.root is not None:
            return {**self._snapshots.reference(self._built), **self._setup.unstored_rows(self._tables),
                    **self._lifecycle.saved(self._built)}
        engine = self._built()  # first: under storage auto, only the plan says whether there is an SSD tier
        if self.gathers_ssd_rows:
            raise GatheringSsdRowsError(_gathering_refusal(type(self).__name__, [t.name for t in self._tables]))
        # Per table, whatever the sharding: a checkpoint loads into any number of ranks.
        # When sharded this is collective (Lightning builds checkpoints on every rank). The
        # widths go along for readers of the file alone (export: rows hold optimizer state too).
        return {"tables": engine.export(), "dims": {t.name: t.embedding_dim for t in self._tables},
                **self._setup.unstored_rows(self._tables), **self._lifecycle.saved(self._built)}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self._lifecycle.take(state)  # with the rows, or at once where they load now
        if "snapshot" in state:
            found = self._snapshots.to_load(state, self.snapshot_search)
            if found is None:
                return  # loaded already (the second name of this module)
            if self._defer_load():
                self._pending_load = ("snapshot", *found)
                self._snapshots.refer_to(found[1])  # the module's second name returns above
                return
            self.load_tables(found[0])
            self._snapshots.refer_to(found[1])
            return
        if "tables" not in state:
            raise KeyError("checkpoint holds no 'tables' state for the TieredEmbeddingBagCollection")
        self._load_rows(state["tables"])

    def _load_rows(self, tables: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace every stored row by ``tables`` (:meth:`TableEngine.export`'s form)."""
        self._snapshots.rows_replaced()  # rows from a state dict: the next snapshot holds them all
        if self._defer_load():
            self._pending_load = ("tables", tables)
            return
        self._built().load(tables)

    def _defer_load(self) -> bool:
        """Whether restored rows wait for the first use: under storage auto, until the tiers
        are planned (:meth:`plan_placement` at the start of fit, on the module's device)."""
        return self._auto_storage is not None and self._engine is None

    # -- torchrec's state dict -------------------------------------------------------------

    def torchrec_state_dict(self, prefix: str = "", chunk_rows: int = 1 << 16) -> dict[str, torch.Tensor]:
        """What torchrec's ``EmbeddingBagCollection.state_dict()`` holds: per table
        ``{prefix}embedding_bags.<table>.weight``, float32 ``[num_embeddings, dim]``, row ``i``
        the current weights of id ``i`` (its initial value if nobody trained it). torchrec's
        weight has no optimizer state, so neither has this.

        Refused before anything is gathered: weights larger together than the memory available
        (MemoryError; :meth:`save_tables` streams rows instead); a table of hashed ids that
        stores rows of ids ``>= num_embeddings``, which torchrec's weight has no place for
        (ValueError); a collection sharded over ranks (RuntimeError: save its tables and load
        them into a collection in one process).

        Example::

            torchrec_ebc = EmbeddingBagCollection(tables=ebc.embedding_bag_configs())
            torchrec_ebc.load_state_dict(ebc.torchrec_state_dict())   # same pooled output
        """
        return torchrec_weights(self._built(), self._tables, self._setup, prefix, chunk_rows)

    def load_torchrec_state_dict(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "",
                                 strict: bool = True) -> None:
        """Replace every row by the weights of torchrec's ``EmbeddingBagCollection.state_dict()``:
        ``{prefix}embedding_bags.<table>.weight`` ``[num_embeddings, dim]`` of every table, row
        ``i`` becoming the stored row of id ``i`` (for hashed ids too: ids ``0 .. num_embeddings -
        1``, the ids torchrec's table has); rows stored before are dropped, as any load replaces
        them. The rows start with zero optimizer state and step counts of 0, as a fresh torchrec
        optimizer does. Keys outside ``{prefix}embedding_bags.`` are ignored (a whole model's
        state dict may be passed); with ``strict``, one there that names no table is an error.
        :meth:`load_state_dict` takes such a state dict too. Not collective: under
        torch.distributed every rank passes the same state dict and keeps the rows it owns.

        Example::

            ebc.load_torchrec_state_dict(torchrec_ebc.state_dict())
            model.load_state_dict(torchrec_model.state_dict())   # the same, inside a model
        """
        self._load_rows(rows_from_torchrec(state_dict, self._tables, self._setup, prefix, strict))

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        # torchrec's keys and none of this collection's own: a torchrec collection's state dict.
        if (prefix + "_extra_state" not in state_dict
                and any(k.startswith(prefix + "embedding_bags.") for k in state_dict)):
            try:
                self.load_torchrec_state_dict(state_dict, prefix, strict=False)
            except (KeyError, ValueError) as e:
                error_msgs.append(e.args[0] if e.args else str(e))
            if strict:
                wanted = {f"{prefix}embedding_bags.{t.name}.weight" for t in self._tables}
                unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in wanted)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    # -- copies ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What a copy carries (``copy.deepcopy``, pickle, ``torch.save(module)``): every row,
        for a collection whose rows all live in this process's memory; the copy shares nothing
        mutable with this one. Refused (TypeError, before anything is copied) for a collection
        with an SSD tier, whose copy would share its files, and for one sharded over ranks."""
        sharded = self._process_group is not None or (self._engine is not None
                                                      and not isinstance(self._engine, LocalTables))
        refuse_copy(type(self).__name__, [t.name for t in self._tables], self._ssd_dirs(), sharded)
        if self._auto_storage is not None and self._engine is None and self._copy_lineage is None:
            # Both are planned at their first use, on this machine alike: the second of them
            # planned an SSD tier where the first has one is refused (see _place).
            self._copy_lineage = uuid.uuid4().hex
        state = super().__getstate__()
        # Set by a TableSnapshots callback for its run (a closure over the trainer): not the copy's.
        state["snapshot_search"] = list
        return state


def _gathering_refusal(owner: str, tables: list[str]) -> str:
    return (f"{owner}: a state dict of tables {tables} would gather into memory every row their SSD tier holds (a "
            f"table larger than memory cannot be saved so: the process would be killed). Add "
            f"ctr_lightning.callbacks.TableSnapshots() to the Trainer's callbacks (checkpoints then stream the rows to "
            f"table snapshots), or return ctr_lightning.callbacks.table_snapshots_by_default(self) from the "
            f"LightningModule's configure_callbacks (CTRModule models do), or call checkpoint_to_snapshots(None) on "
            f"the collection to gather whole rows on purpose.")
