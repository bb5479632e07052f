"""Tables that share one set of tiers: same dim, pooling and SSD directory."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from ctr_lightning.embedding import cpu_kernels as kernels
from ctr_lightning.embedding.initializer import initial_rows, initialize_slots, table_key
from ctr_lightning.embedding.key_index import KeyIndex, dedup
from ctr_lightning.embedding.optimizers import SparseAdam, SparseOptimizer
from ctr_lightning.embedding.row_cache import RowCache, Rows
from ctr_lightning.embedding.sparse_update import apply_update, kernel_optimizer, state_width
from ctr_lightning.embedding.ssd import DirectSsdStore, SsdStore
from ctr_lightning.embedding.staging import StagedChunk, StagedRows
from ctr_lightning.embedding.storage_config import StorageConfig


_RESERVE_BYTES = 4 << 30


class TableGroup:
    """The tiers of a few tables and the per-step work on them: dedup, fetch, pool, update.

    Rows are ``[weights | optimizer state]`` in every tier. The device tier is the one
    the compute reads; misses come from the host tier, then the SSD tier, then the
    counter-based initializer. Evicted dirty rows go one tier down; clean ones are
    dropped, since the tier below (or the initializer) already has them.
    """

    def __init__(
        self,
        name: str,
        tables: list[EmbeddingBagConfig],
        storage: list[StorageConfig],
        bounded_ids: list[bool],
        optimizer: SparseOptimizer,
        device: torch.device,
        seed: int,
        kernel: str = "auto",
    ) -> None:
        self.name = name
        self.tables = tables
        self.names = [t.name for t in tables]
        self.dim = tables[0].embedding_dim
        self.mode = "mean" if tables[0].pooling == PoolingType.MEAN else "sum"
        self.optimizer = optimizer
        self.width = self.dim + state_width(optimizer, self.dim)
        self.seed = seed
        self.table_keys = np.array([table_key(t.name) for t in tables], dtype=np.int64)
        row_bytes = self.width * 4
        self.num_embeddings = np.array([t.num_embeddings for t in tables], dtype=np.int64)
        self.bounded = np.array(bounded_ids, dtype=bool)
        self.bounds = np.array([math.sqrt(1.0 / t.num_embeddings) for t in tables])
        self.steps = np.zeros(len(tables), dtype=np.int64)
        lfu = [s.eviction == "lfu" for s in storage]
        device_caps, host_caps = self.check_storage(self.names, storage, row_bytes)
        ssd_dir = storage[0].ssd_dir
        # Unbounded tiers reserve address space for every row the configs expect (never more
        # than _RESERVE_BYTES); untouched pages of the reservation cost no memory.
        reserve = int(min(self.num_embeddings.sum(), _RESERVE_BYTES // row_bytes))
        self.device_tier = RowCache(self.width, device_caps, lfu, device, reserve_rows=reserve)
        needs_host = any(c is not None for c in device_caps) and any(c != 0 for c in host_caps)
        self.host_tier = RowCache(self.width, host_caps, lfu, "cpu", reserve_rows=reserve) if needs_host else None
        self.ssd: SsdStore | DirectSsdStore | None = None
        if ssd_dir is not None and self.bounded.all():
            self.ssd = DirectSsdStore(ssd_dir, name, self.width, self.names, list(self.num_embeddings))
        elif ssd_dir is not None:
            self.ssd = SsdStore(ssd_dir, name, self.width, self.names)
        self._pinned: list[np.ndarray] = []
        if kernel not in ("auto", "numba", "torch"):
            raise ValueError(f"kernel must be 'auto', 'numba' or 'torch', got {kernel!r}")
        if kernel == "numba" and self.device_tier.device.type != "cpu":
            raise ValueError("kernel='numba' needs the device tier in CPU memory")
        self.kernel = kernel
        self.use_numba = kernel == "numba" or (kernel == "auto" and self.device_tier.device.type == "cpu")
        # Autograd only calls a Function's backward when an input needs a gradient.
        self._placeholder = torch.zeros(0, requires_grad=True)
        self.stats = {"device_hits": 0, "host_hits": 0, "ssd_hits": 0, "new_rows": 0, "prefetch_hits": 0,
                      "prefetched_rows": 0, "prefetch_bytes": 0, "prefetch_failures": 0, "prefetch_stale": 0, "ssd_stall_us": 0}
        # Working-set prefetch (see WorkingSetPrefetcher): rows read ahead, and which
        # upcoming batch last needs each registered row.
        self.staged = StagedRows()
        self.upcoming = KeyIndex()
        self._registered: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._dedup_cache: dict[int, tuple[np.ndarray, ...]] = {}
        self.current_batch: int | None = None  # the batch running now, when prefetching

    @staticmethod
    def check_storage(names: list[str], storage: list[StorageConfig],
                      row_bytes: int) -> tuple[list[int | None], list[int | None]]:
        """The device and host capacities in rows; errors for tiers that cannot work together."""
        device_caps = [s.device_capacity(row_bytes) for s in storage]
        host_caps = [s.host_capacity(row_bytes) for s in storage]
        ssd_dir = storage[0].ssd_dir
        for t, dev, host in zip(names, device_caps, host_caps):
            if host and ssd_dir is None:
                raise ValueError(f"table {t!r}: a bounded host tier needs StorageConfig.ssd_dir for the rest")
            if dev is not None and host is not None and ssd_dir is None:
                raise ValueError(f"table {t!r}: bounded device and host tiers need an SSD tier")
        needs_host = any(c is not None for c in device_caps) and any(c != 0 for c in host_caps)
        if needs_host and any(c == 0 for c in host_caps):
            raise ValueError(f"tables {names}: a host capacity of 0 (no host tier) must hold for "
                             f"every table that shares an SSD directory and dim")
        return device_caps, host_caps

    def move_device_tier(self, device: torch.device) -> None:
        """Follow ``module.to(device)``: the device tier moves, the host and SSD tiers stay."""
        if device == self.device_tier.device:
            return
        if self.kernel == "numba" and device.type != "cpu":
            raise ValueError("kernel='numba' needs the device tier in CPU memory")
        self.device_tier.values = self.device_tier.values.to(device)
        self.device_tier.device = device
        self.use_numba = self.kernel == "numba" or (self.kernel == "auto" and device.type == "cpu")

    # -- forward -------------------------------------------------------------------------

    def validate(self, tables: np.ndarray, ids: np.ndarray) -> None:
        if not self.bounded.any() and (not len(ids) or ids.min() >= 0):
            return  # the common case, hashed ids: only the sign to check
        bad = ids < 0
        bad |= self.bounded[tables] & (ids >= self.num_embeddings[tables])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            t = int(tables[i])
            why = "negative" if ids[i] < 0 else f"outside [0, {int(self.num_embeddings[t])})"
            raise ValueError(f"table {self.names[t]!r}: id {int(ids[i])} is {why}")

    def lookup(
        self, ids: np.ndarray, tables: np.ndarray, offsets: torch.Tensor, weights: torch.Tensor | None,
        batch: int, train: bool,
    ) -> torch.Tensor:
        """Pooled ``[batch, features * dim]`` embeddings (bags are feature-major).

        With ``train``, the touched rows are updated by the sparse optimizer in backward.
        """
        first, inverse, slots = self._unique_slots(ids, tables)
        u_tables, u_ids = tables[first], ids[first]
        miss = slots < 0
        self.stats["device_hits"] += int((~miss).sum())
        if miss.any():
            slots[miss] = self._fetch(u_tables[miss], u_ids[miss], pinned=slots[~miss])
        self.device_tier.touch(slots)
        if train:
            self._pinned.append(slots)
        on_grad = (lambda grad_or_ctx: self._update(slots, u_tables, grad_or_ctx)) if train else None
        if self.use_numba:
            return self._lookup_cpu(slots, inverse, offsets, weights, batch, on_grad)
        return self._lookup_torch(slots, inverse, offsets, weights, batch, on_grad)

    def _lookup_cpu(self, slots, inverse, offsets, weights, batch, on_grad) -> torch.Tensor:
        # Fused numba kernels read and update the storage in place: no gathered copies.
        offsets_np = offsets.numpy().astype(np.int64, copy=False)
        weights_np = (weights.numpy().astype(np.float32, copy=False) if weights is not None
                      else np.empty(0, dtype=np.float32))
        inputs = (slots, inverse, offsets_np, weights_np, batch)
        if on_grad is None:
            return self._pool_cpu(inputs)
        return _FusedCpuPooling.apply(self._placeholder, self, inputs, on_grad)

    def _pool_cpu(self, inputs: tuple) -> torch.Tensor:
        slots, inverse, offsets, weights, batch = inputs
        out = torch.empty(batch, (len(offsets) - 1) // batch * self.dim)
        kernels.pool_forward(self.device_tier.values.numpy(), self.dim, slots, inverse, offsets, weights,
                             self.mode == "mean", batch, out.numpy())
        return out

    def _lookup_torch(self, slots, inverse, offsets, weights, batch, on_grad) -> torch.Tensor:
        device = self.device_tier.device
        gathered = self.device_tier.values[:, : self.dim].index_select(0, torch.from_numpy(slots).to(device))
        inverse_t = torch.from_numpy(inverse).to(device)
        offsets = offsets.to(device)
        weights = None if weights is None else weights.to(device, torch.float32)
        if on_grad is None:
            pooled = F.embedding_bag(inverse_t, gathered, offsets, mode=self.mode,
                                     per_sample_weights=weights, include_last_offset=True)
        else:
            gathered.requires_grad_(True)  # so autograd reaches _PooledRows.backward
            pooled = _PooledRows.apply(gathered, inverse_t, offsets, weights, self.mode, on_grad)
        return pooled.reshape(-1, batch, self.dim).transpose(0, 1).reshape(batch, -1)

    def _fetch(self, tables: np.ndarray, ids: np.ndarray, pinned: np.ndarray) -> np.ndarray:
        rows = torch.empty(len(ids), self.width)
        filled = np.zeros(len(ids), dtype=bool)
        if self.host_tier is not None:
            hslots = self.host_tier.lookup(tables, ids)
            hit = hslots >= 0
            if hit.any():
                rows[torch.from_numpy(np.flatnonzero(hit))] = self.host_tier.values[torch.from_numpy(hslots[hit])]
                filled |= hit
                self.stats["host_hits"] += int(hit.sum())
        if self.ssd is not None and not filled.all():
            rest = np.flatnonzero(~filled)
            if self.current_batch is not None:
                found, data, stale = self.staged.take(tables[rest], ids[rest], self._ssd_tokens)
                self.stats["prefetch_stale"] += stale
                if found.any():
                    rows[torch.from_numpy(rest[found])] = data
                    filled[rest[found]] = True
                    self.stats["prefetch_hits"] += int(found.sum())
                    rest = rest[~found]
            start = time.perf_counter()
            found, data, _ = self.ssd.read(tables[rest], ids[rest])
            self.stats["ssd_stall_us"] += int((time.perf_counter() - start) * 1e6)
            if found.any():
                rows[torch.from_numpy(rest[found])] = torch.from_numpy(data)
                filled[rest[found]] = True
                self.stats["ssd_hits"] += int(found.sum())
        need = self.device_tier.room_needed(tables)
        pinned_all = np.concatenate([pinned, *self._pinned]) if self._pinned else pinned
        victim_slots, victims = self.device_tier.choose_victims(need, pinned_all, self.names,
                                                                needed_after=self.current_batch)
        self._demote(victims.select(victims.dirty))
        self.device_tier.release(victim_slots)
        clean = np.zeros(len(ids), dtype=bool)
        if filled.all():
            slots = self.device_tier.insert(Rows(tables, ids, rows, clean))
        else:
            slots = np.empty(len(ids), dtype=np.int64)
            old, new = np.flatnonzero(filled), np.flatnonzero(~filled)
            if len(old):
                slots[old] = self.device_tier.insert(Rows(tables[old], ids[old], rows[torch.from_numpy(old)], clean[old]))
            # Rows never stored anywhere start from the initializer, written in place.
            slots[new] = self.device_tier.place(tables[new], ids[new], clean[new], absent=True)
            self._initialize(slots[new], tables[new], ids[new])
            self.stats["new_rows"] += len(new)
        if self.current_batch is not None and len(self.upcoming):
            self.device_tier.needed_until[slots] = self.upcoming.lookup(ids, tables)
        return slots

    # -- working-set prefetch --------------------------------------------------------------

    def _unique_slots(self, ids: np.ndarray, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first, inverse, slots)`` of validated ids: the unique (table, id) pairs in order
        of first appearance and their device-tier slots (-1: absent). Reuses the dedup that
        :meth:`register` or :meth:`dedup_ahead` did on this same batch (the cache is keyed by
        the ids' memory and checked for equality)."""
        cached = self._dedup_cache.pop(ids.ctypes.data, None) if self._dedup_cache else None
        if (cached is not None and len(cached[0]) == len(ids) and np.array_equal(cached[0], ids)
                and np.array_equal(cached[1], tables)):
            first, inverse = cached[2], cached[3]
            return first, inverse, self.device_tier.lookup(tables[first], ids[first])
        self.validate(tables, ids)
        return self.device_tier.lookup_unique(tables, ids)

    def dedup_ahead(self, ids: np.ndarray, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Validate and deduplicate ids before their lookup, which then reuses the result."""
        self.validate(tables, ids)
        first, inverse = dedup(ids, tables)
        self._remember_dedup(ids, tables, first, inverse)
        return first, inverse

    def _remember_dedup(self, ids: np.ndarray, tables: np.ndarray, first: np.ndarray, inverse: np.ndarray) -> None:
        self._dedup_cache[ids.ctypes.data] = (ids, tables, first, inverse)
        while len(self._dedup_cache) > 64:  # batches read ahead but never looked up (evaluation)
            self._dedup_cache.pop(next(iter(self._dedup_cache)))

    def _ssd_tokens(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return self.ssd.locate(tables, ids)[1]

    def register(self, tables: np.ndarray, ids: np.ndarray, batch: int,
                 reuse_dedup: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Note that upcoming ``batch`` needs these rows: those in memory are spared from
        eviction until it has run. Returns the rows to read ahead: in neither memory tier.
        With ``reuse_dedup`` the lookup of these same ``ids`` arrays reuses the dedup.

        Training thread only; batches are registered in increasing order.
        """
        if self.current_batch is None:
            self.current_batch = batch
        first, inverse, slots = self._unique_slots(ids, tables)
        if reuse_dedup:
            self._remember_dedup(ids, tables, first, inverse)
        tables, ids = tables[first], ids[first]
        present = slots >= 0
        self.device_tier.needed_until[slots[present]] = batch
        # Rows not in the device tier get their batch noted, to be spared once they arrive.
        tables, ids = tables[~present], ids[~present]
        self.upcoming.insert(ids, tables, np.full(len(ids), batch, dtype=np.int64))
        self._registered[batch] = (tables, ids)
        if self.host_tier is not None:
            in_host = self.host_tier.lookup(tables, ids) >= 0
            tables, ids = tables[~in_host], ids[~in_host]
        return tables, ids

    def stage(self, tables: np.ndarray, ids: np.ndarray, batch: int) -> None:
        """Read the SSD copies of these rows into DRAM for ``batch`` (prefetch thread)."""
        if self.ssd is None or not len(ids):
            return
        try:
            records, tokens, fd = self.ssd.locate(tables, ids)
            there = records >= 0
            rows = self.ssd.read_located(records[there], fd)
        except OSError:
            # A compaction closed the file under the read: those rows come on demand.
            self.stats["prefetch_failures"] += 1
            return
        self.staged.put(StagedChunk(batch, tables[there], ids[there], tokens[there], rows))
        self.stats["prefetched_rows"] += len(rows)
        self.stats["prefetch_bytes"] += rows.nbytes

    def release(self, batch: int) -> None:
        """``batch`` has run: drop what was read ahead for it and its spared rows."""
        self.current_batch = batch + 1
        self.staged.release(batch)
        for b in [b for b in self._registered if b <= batch]:
            tables, ids = self._registered.pop(b)
            last = self.upcoming.lookup(ids, tables)
            done = last <= batch
            self.upcoming.remove(ids[done], tables[done])

    def stop_prefetch(self) -> None:
        """Back to fetching on demand only."""
        self.current_batch = None
        self.staged.clear()
        self.upcoming.clear()
        self._registered.clear()
        self._dedup_cache.clear()

    def _initial(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return initial_rows(self.seed, self.table_keys[tables], ids, self.dim, self.bounds[tables])

    def _initialize(self, slots: np.ndarray, tables: np.ndarray, ids: np.ndarray) -> None:
        """Device-tier rows at ``slots`` := initial weights and zero optimizer state."""
        values = self.device_tier.values
        if values.device.type == "cpu":
            initialize_slots(self.seed, self.table_keys[tables], ids, self.dim, self.bounds[tables], values.numpy(),
                             slots)
            return
        rows = torch.zeros(len(ids), self.width)
        rows[:, : self.dim] = torch.from_numpy(self._initial(tables, ids))
        values[torch.from_numpy(slots).to(values.device)] = rows.to(values.device)

    def _demote(self, rows: Rows) -> None:
        """Write dirty rows leaving the device tier into the host tier (or the SSD)."""
        if not len(rows):
            return
        if self.host_tier is None:
            self._write_ssd(rows)
            return
        need = self.host_tier.room_needed(rows.tables)
        victim_slots, victims = self.host_tier.choose_victims(need, np.empty(0, dtype=np.int64), self.names)
        self._write_ssd(victims.select(victims.dirty))
        self.host_tier.release(victim_slots)
        self.host_tier.insert(Rows(rows.tables, rows.ids, rows.values.cpu(), np.ones(len(rows), dtype=bool)))

    def _write_ssd(self, rows: Rows) -> None:
        if not len(rows):
            return
        if self.ssd is None:
            raise RuntimeError(f"tables {self.names}: rows must leave memory but no SSD tier is configured")
        self.ssd.write(rows.tables, rows.ids, rows.values.cpu().numpy())

    # -- backward ------------------------------------------------------------------------

    def _update(self, slots: np.ndarray, tables: np.ndarray, grad: torch.Tensor | _CpuBackward) -> None:
        # Every table in the batch counts a step, as torch.optim.SparseAdam counts per parameter.
        self.steps += 1
        if isinstance(grad, _CpuBackward):
            self._update_cpu(slots, tables, grad)
        else:
            # On the storage's device, where the rows are (not necessarily the gradient's).
            device = self.device_tier.values.device
            index = torch.from_numpy(slots).to(device)
            rows = self.device_tier.values.index_select(0, index)
            step_t = torch.from_numpy(self.steps[tables]).to(device)
            self.device_tier.values.index_copy_(0, index, apply_update(self.optimizer, rows, grad.to(device), step_t))
        self.device_tier.dirty[slots] = True
        self._pinned = [p for p in self._pinned if p is not slots]

    def _update_cpu(self, slots: np.ndarray, tables: np.ndarray, ctx: _CpuBackward) -> None:
        opt = self.optimizer
        kind, params = kernel_optimizer(opt)
        step_scale = np.zeros(len(slots), dtype=np.float32)
        if isinstance(opt, SparseAdam):
            beta1, beta2 = opt.betas
            step = self.steps.astype(np.float64)  # one bias correction per table, then per row
            step_scale = (opt.lr * np.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)).astype(np.float32)[tables]
        inverse, offsets, weights, batch = ctx.inverse, ctx.offsets, ctx.weights, ctx.batch
        row_ptr, positions = kernels.occurrences_by_row(inverse, len(slots))
        bag = kernels.bag_of_ids(offsets, len(inverse))
        kernels.backward_update(self.device_tier.values.numpy(), self.dim, slots, row_ptr, positions, bag,
                                offsets, weights, self.mode == "mean", batch, ctx.grad_out, kind, params,
                                step_scale)

    # -- reads without side effects, and checkpoints --------------------------------------

    def rows(self, table: int, ids: np.ndarray) -> torch.Tensor:
        return self.full_rows(np.full(len(ids), table, dtype=np.int64), ids)[:, : self.dim]

    def full_rows(self, tables: np.ndarray, ids: np.ndarray) -> torch.Tensor:
        """``[weights | optimizer state]`` of rows, freshest tier first; reads only."""
        self.validate(tables, ids)
        out = torch.zeros(len(ids), self.width)
        out[:, : self.dim] = torch.from_numpy(self._initial(tables, ids))
        todo = np.ones(len(ids), dtype=bool)
        for tier in (self.device_tier, self.host_tier):
            if tier is None:
                continue
            slots = tier.lookup(tables, ids)
            hit = todo & (slots >= 0)
            if hit.any():
                out[torch.from_numpy(np.flatnonzero(hit))] = (
                    tier.values[torch.from_numpy(slots[hit]).to(tier.device)].cpu())
                todo &= ~hit
        if self.ssd is not None and todo.any():
            rest = np.flatnonzero(todo)
            found, data, _ = self.ssd.read(tables[rest], ids[rest])
            out[torch.from_numpy(rest[found])] = torch.from_numpy(data)
        return out

    def put_rows(self, tables: np.ndarray, ids: np.ndarray, values: torch.Tensor) -> None:
        """Overwrite rows (unique keys) with ``[weights | optimizer state]`` values."""
        caps = self.device_tier.capacity[self.device_tier.capacity > 0]
        chunk = max(1, int(caps.min()) // 2) if len(caps) else max(1, len(ids))
        for start in range(0, len(ids), chunk):
            t, i = tables[start : start + chunk], ids[start : start + chunk]
            slots = self.device_tier.lookup(t, i)
            miss = slots < 0
            if miss.any():
                slots[miss] = self._fetch(t[miss], i[miss], pinned=slots[~miss])
            index = torch.from_numpy(slots).to(self.device_tier.device)
            self.device_tier.values[index] = values[start : start + chunk].to(self.device_tier.device)
            self.device_tier.dirty[slots] = True

    def export(self) -> dict[str, torch.Tensor | list[str]]:
        """Every stored row, freshest copy first: device (dirty) over host over SSD."""
        parts: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []
        device_rows = self.device_tier.entries()
        if self.host_tier is None and self.ssd is None:
            parts.append((device_rows.tables, device_rows.ids, device_rows.values.cpu()))
        else:
            dirty = device_rows.select(device_rows.dirty)
            parts.append((dirty.tables, dirty.ids, dirty.values.cpu()))
        if self.host_tier is not None:
            host = self.host_tier.entries()
            parts.append((host.tables, host.ids, host.values))
        if self.ssd is not None:
            tables, ids, data = self.ssd.entries()
            parts.append((tables, ids, torch.from_numpy(data)))
        tables = np.concatenate([p[0] for p in parts])
        ids = np.concatenate([p[1] for p in parts])
        first, _ = dedup(ids, tables)  # first occurrence = freshest tier
        values = torch.cat([p[2] for p in parts])[torch.from_numpy(first)]
        return {"tables": list(self.names), "table": torch.from_numpy(tables[first]),
                "id": torch.from_numpy(ids[first]), "rows": values, "steps": torch.from_numpy(self.steps.copy())}

    def load(self, tables: np.ndarray, ids: np.ndarray, rows: torch.Tensor, steps: np.ndarray) -> None:
        """Replace every stored row by ``rows`` of (``tables``, ``ids``); ``steps`` per table."""
        self.device_tier.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.ssd is not None:
            self.ssd.clear()
        self.steps = np.asarray(steps, dtype=np.int64).copy()
        loaded = Rows(tables, ids, rows, np.ones(len(ids), dtype=bool))
        if self.ssd is not None:
            self._write_ssd(loaded)
        elif self.host_tier is not None:
            self.host_tier.insert(loaded)
        else:
            self.device_tier.insert(loaded)


class _PooledRows(torch.autograd.Function):
    """Pooling of gathered rows whose backward hands each row's summed gradient to ``on_grad``.

    The gradient goes straight to the fused optimizer: nothing flows back to a parameter.
    It is accumulated with one index_add over all ids, cheaper than embedding_bag's own
    backward, which builds a gradient for a weight that is thrown away here.
    """

    @staticmethod
    def forward(ctx, rows, inverse, offsets, weights, mode, on_grad):  # type: ignore[override]
        ctx.save_for_backward(inverse, offsets, weights)
        ctx.mode, ctx.on_grad, ctx.num_rows = mode, on_grad, rows.shape[0]
        return F.embedding_bag(inverse, rows, offsets, mode=mode, per_sample_weights=weights,
                               include_last_offset=True)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        inverse, offsets, weights = ctx.saved_tensors
        lengths = offsets[1:] - offsets[:-1]
        bag_of_id = torch.repeat_interleave(torch.arange(len(lengths), device=grad_out.device), lengths)
        per_id = grad_out.index_select(0, bag_of_id)
        if weights is not None:
            per_id = per_id * weights.unsqueeze(1)
        if ctx.mode == "mean":
            per_id = per_id / lengths.index_select(0, bag_of_id).unsqueeze(1).to(per_id.dtype)
        grad_rows = torch.zeros(ctx.num_rows, grad_out.shape[1], dtype=grad_out.dtype, device=grad_out.device)
        grad_rows.index_add_(0, inverse, per_id)
        ctx.on_grad(grad_rows)
        return None, None, None, None, None, None


class _CpuBackward:
    """What the fused CPU backward needs: the batch's layout and the output gradient."""

    def __init__(self, inverse, offsets, weights, batch, grad_out) -> None:
        self.inverse, self.offsets, self.weights, self.batch = inverse, offsets, weights, batch
        self.grad_out = grad_out


class _FusedCpuPooling(torch.autograd.Function):
    """Pooling by :func:`kernels.pool_forward`; backward runs the fused optimizer kernel."""

    @staticmethod
    def forward(ctx, placeholder, group, inputs, on_grad):  # type: ignore[override]
        ctx.inputs, ctx.on_grad = inputs, on_grad
        return group._pool_cpu(inputs)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        _, inverse, offsets, weights, batch = ctx.inputs
        grad = grad_out.contiguous().numpy()
        ctx.on_grad(_CpuBackward(inverse, offsets, weights, batch, grad))
        return None, None, None, None
