"""How a collection's tables are stored and trained: every setting, checked once."""

from __future__ import annotations

import contextvars
import dataclasses
import errno
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from ctr_lightning.embedding.admission_config import Admission
from ctr_lightning.embedding.expiry_config import Expiry
from ctr_lightning.embedding.initializer import init_range
from ctr_lightning.embedding.lifecycle.row_expiry import SCORE_WORDS, STAMP_WORDS
from ctr_lightning.embedding.lifecycle.sighting_sketch import DEPTH, MIN_WIDTH, PARTITIONS, min_sketch_bytes
from ctr_lightning.embedding.kernels.sparse_update import state_width
from ctr_lightning.embedding.optimizers import SparseAdam, SparseOptimizer
from ctr_lightning.embedding.storage_config import StorageConfig

KERNELS = ("auto", "numba", "torch")
ID_SPACES = ("hashed", "bounded")


@dataclass(frozen=True)
class TableSetup:
    """How a collection's tables are stored and trained, per table where it differs.

    Made by :meth:`build`, which checks every setting once (storage tiers, id spaces,
    pooling, initial ranges, kernel, SSD directories), so nothing below it checks again.
    The engines take it whole and derive the setups of their parts from it.

    Example::

        setup = TableSetup.build(tables, storage=StorageConfig(ssd_dir="/nvme/run1"))
        LocalTables(tables, setup.for_rank(1))   # rank 1's SSD files under /nvme/run1/rank1
    """

    storage: Mapping[str, StorageConfig]
    id_space: Mapping[str, str]
    is_weighted: bool
    optimizer: SparseOptimizer
    device: torch.device
    seed: int
    kernel: str
    # Per table, the uniform range ``(low, high)`` its rows start in (:func:`init_range`).
    init_range: Mapping[str, tuple[float, float]]
    module_name: str = "TieredEmbeddingBagCollection"  # named in error messages
    # Per table, its feature admission (absent: every id gets a row).
    admission: Mapping[str, Admission] = field(default_factory=dict)
    # Per table, its row expiry (absent: rows stay).
    expiry: Mapping[str, Expiry] = field(default_factory=dict)
    # Per row-wise shard, ``(world, rank)``: which of the table's ids this process owns.
    row_partition: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        tables: Sequence[EmbeddingBagConfig],
        storage: StorageConfig | Mapping[str, StorageConfig] | None = None,
        optimizer: SparseOptimizer | None = None,
        id_space: str | Mapping[str, str] = "hashed",
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        seed: int = 0,
        kernel: str = "auto",
        module_name: str = "TieredEmbeddingBagCollection",
        admission: Admission | Mapping[str, Admission | None] | None = None,
        expiry: Expiry | Mapping[str, Expiry | None] | None = None,
    ) -> TableSetup:
        """The setup of ``tables``, or a ValueError naming the table and setting at fault."""
        names = [t.name for t in tables]
        setup = cls(
            storage=_per_table(storage if storage is not None else StorageConfig(), names, "storage", StorageConfig),
            id_space=_per_table(id_space, names, "id_space", str),
            is_weighted=is_weighted,
            optimizer=optimizer if optimizer is not None else SparseAdam(),
            device=torch.device(device or "cpu"),
            seed=seed,
            kernel=kernel,
            init_range={t.name: init_range(t) for t in tables},
            module_name=module_name,
            expiry=_settings_per_table(expiry, names, "expiry", Expiry, lambda s: True),
        )
        setup = dataclasses.replace(setup, admission=_admission_per_table(admission, names, setup.expiry))
        for name, space in setup.id_space.items():
            if space not in ID_SPACES:
                raise ValueError(f"table {name!r}: id_space must be 'hashed' or 'bounded', got {space!r}")
            if space == "bounded" and name in setup.expiry:
                raise ValueError(f"table {name!r}: Expiry is for tables of hashed ids (id_space='hashed'), whose "
                                 f"rows grow with the data; this table's ids are bounded (num_embeddings rows at most)")
        for t in tables:
            if t.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {t.name!r}: pooling {t.pooling.name} is not supported (SUM or MEAN)")
            if is_weighted and t.pooling != PoolingType.SUM:
                raise ValueError(f"table {t.name!r}: weighted bags need SUM pooling, got {t.pooling.name}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be 'auto', 'numba' or 'torch', got {kernel!r}")
        check_kernel_device(kernel, setup.device)
        dram: dict[str, int] = {}
        for members in setup.groups(tables):
            group = [tables[i] for i in members]
            device, host = setup.capacities(group, check=True)
            row_bytes = setup.row_width(group[0].embedding_dim, [t.name for t in group]) * 4
            for t, dev, cap in zip(group, device, host):
                in_dram = (dev or 0) * (setup.device.type == "cpu") + (cap or 0) * has_host_tier(device, host)
                dram[t.name] = in_dram * row_bytes
            storage = setup.storage[group[0].name]
            if storage.ssd_dir is not None and MACHINE_CHECKS.get():
                _check_directory(storage.ssd_dir, [t.name for t in group], storage.ssd_segment_bytes)
        if MACHINE_CHECKS.get():
            _check_dram(dram, module_name)
        return setup

    def with_storage(self, tables: Sequence[EmbeddingBagConfig],
                     storage: StorageConfig | Mapping[str, StorageConfig]) -> TableSetup:
        """This setup built anew, and checked, with the tiers a placement plan gave ``tables``;
        every other setting as it is."""
        return TableSetup.build(tables, storage, self.optimizer, dict(self.id_space), self.is_weighted, self.device,
                                self.seed, self.kernel, module_name=self.module_name, admission=dict(self.admission),
                                expiry=dict(self.expiry))

    def tiers(self, tables: Sequence[EmbeddingBagConfig]) -> dict[str, dict[str, Any]]:
        """Per table, its tiers' capacities in rows (None: every row), SSD directory and
        row bytes (see :meth:`TieredEmbeddingBagCollection.table_tiers`)."""
        out = {}
        for table in tables:
            storage = self.storage[table.name]
            row_bytes = 4 * self.row_width(table.embedding_dim, [table.name])
            device, host = storage.device_capacity(row_bytes), storage.host_capacity(row_bytes)
            # A host tier exists only below a bounded device tier (see has_host_tier).
            out[table.name] = {"device_rows": device, "host_rows": host if device is not None and host != 0 else 0,
                               "ssd_dir": storage.ssd_dir, "row_bytes": row_bytes}
        return out

    @property
    def scored_tables(self) -> list[str]:
        """The tables whose row cap keeps rows by a score (LFU, show/click)."""
        return sorted(name for name, e in self.expiry.items() if e.scored)

    @property
    def click_tables(self) -> list[str]:
        """The tables whose score counts clicks: their lookups need the batch's labels."""
        return sorted(name for name, e in self.expiry.items() if e.score == "show_click")

    @property
    def timed_tables(self) -> list[str]:
        """The tables whose ttl counts in data time."""
        return sorted(name for name, e in self.expiry.items() if e.ttl_seconds is not None)

    def row_width(self, dim: int, tables: Sequence[str] = ()) -> int:
        """Floats stored per row of a group of ``tables``: the weights, the optimizer's state
        and, where a table expires rows, each row's last lookup step."""
        return (self.core_width(dim) + (STAMP_WORDS if any(t in self.expiry for t in tables) else 0)
                + (SCORE_WORDS if any(t in self.expiry and self.expiry[t].scored for t in tables) else 0))

    def core_width(self, dim: int) -> int:
        """Floats of a row the optimizer steps: the weights and its state."""
        return dim + state_width(self.optimizer, dim)

    def groups(self, tables: Sequence[EmbeddingBagConfig]) -> list[list[int]]:
        """Indices of the tables that share one set of tiers and kernel calls: same dim,
        pooling, SSD directory and id space."""
        keys: dict[tuple, list[int]] = {}
        for i, t in enumerate(tables):
            expiry = self.expiry.get(t.name)
            keys.setdefault((t.embedding_dim, t.pooling, self.storage[t.name].ssd_dir, self.id_space[t.name],
                             expiry is not None, expiry is not None and expiry.scored), []).append(i)
        return list(keys.values())

    def capacities(self, group: Sequence[EmbeddingBagConfig],
                   check: bool = False) -> tuple[list[int | None], list[int | None]]:
        """Device and host tier capacities in rows of each table of a group (None:
        unbounded); with ``check``, errors for tiers that cannot work together."""
        row_bytes = self.row_width(group[0].embedding_dim, [t.name for t in group]) * 4
        storage = [self.storage[t.name] for t in group]
        device = [s.device_capacity(row_bytes) for s in storage]
        host = [s.host_capacity(row_bytes) for s in storage]
        if check:
            ssd_dir = storage[0].ssd_dir
            for t, dev, cap in zip(group, device, host):
                if cap and ssd_dir is None:
                    raise ValueError(f"table {t.name!r}: a bounded host tier needs StorageConfig.ssd_dir for the rest")
                if dev is not None and cap is not None and ssd_dir is None:
                    raise ValueError(f"table {t.name!r}: bounded device and host tiers need an SSD tier")
            if has_host_tier(device, host) and any(c == 0 for c in host):
                raise ValueError(f"tables {[t.name for t in group]}: a host capacity of 0 (no host tier) must hold "
                                 f"for every table that shares an SSD directory and dim")
        return device, host

    def use_numba(self, device: torch.device) -> bool:
        """Whether the fused CPU kernels run, for a device tier on ``device``."""
        return self.kernel == "numba" or (self.kernel == "auto" and device.type == "cpu")

    def for_rank(self, rank: int) -> TableSetup:
        """The same, with each SSD directory moved to a ``rank<r>`` subdirectory: ranks on
        one machine must not share SSD files."""
        storage = {name: s if s.ssd_dir is None
                   else dataclasses.replace(s, ssd_dir=os.path.join(s.ssd_dir, f"rank{rank}"))
                   for name, s in self.storage.items()}
        return dataclasses.replace(self, storage=storage)

    def in_subdirectory(self, name: str) -> TableSetup:
        """The same, with each SSD directory moved to a ``name`` subdirectory: another set
        of tables of this process (a rank's data-parallel replicas) must not share SSD files."""
        storage = {table: s if s.ssd_dir is None else dataclasses.replace(s, ssd_dir=os.path.join(s.ssd_dir, name))
                   for table, s in self.storage.items()}
        return dataclasses.replace(self, storage=storage)

    def unstored_rows(self, tables: Sequence[EmbeddingBagConfig]) -> dict[str, Any]:
        """What a reader of a checkpoint alone (the serving export) needs, with the seed, to
        recompute the rows never stored: ``{"init_ranges": {table: [low, high]}}`` of the
        tables whose rows start in another range than torchrec's default
        ``-+sqrt(1 / num_embeddings)``, and ``{"zero_unstored": [table, ...]}`` of those that
        admit ids selectively (a row stored nowhere there reads zeros). Entries at their
        defaults are not written."""
        ranges = {t.name: list(self.init_range[t.name]) for t in tables
                  if self.init_range[t.name] != (-math.sqrt(1 / t.num_embeddings), math.sqrt(1 / t.num_embeddings))}
        zeros = sorted(t.name for t in tables if t.name in self.admission)
        return {**({"init_ranges": ranges} if ranges else {}), **({"zero_unstored": zeros} if zeros else {})}

    def row_wise_shard(self, world: int, rank: int, tables: Sequence[str]) -> TableSetup:
        """The same, for rank ``rank`` of ``world`` holding the rows it owns of ``tables``."""
        return dataclasses.replace(self, row_partition={**self.row_partition, **{t: (world, rank) for t in tables}})

    def in_memory(self) -> TableSetup:
        """The same, with every table held whole in the device tier."""
        return dataclasses.replace(self, storage={name: StorageConfig() for name in self.storage})


def has_host_tier(device_caps: Sequence[int | None], host_caps: Sequence[int | None]) -> bool:
    """A group has a host tier when its device tier is bounded and a host tier is asked for."""
    return any(c is not None for c in device_caps) and any(c != 0 for c in host_caps)


def check_kernel_device(kernel: str, device: torch.device) -> None:
    if kernel == "numba" and device.type != "cpu":
        raise ValueError(f"kernel='numba' needs the device tier in CPU memory, not on {device}")


# Whether tables being set up are checked against this machine (its SSD directories and
# memory): off where they are built to be described for another one (ctr-lightning plan
# --topology), never in a run.
MACHINE_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar("ctr_lightning_machine_checks", default=True)


def _check_directory(path: str, tables: list[str], segment_bytes: int) -> None:
    """The SSD directory exists (or is made), is writable, and has room for a segment file."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"SSD tier of tables {tables}: cannot create files in {path}: {e.strerror}") from e
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, f"SSD tier of tables {tables}: cannot create files in {path}: "
                                   f"read-only file system")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"SSD tier of tables {tables}: cannot create files in {path}: not writable")
    free = shutil.disk_usage(path).free
    if free < segment_bytes:
        raise OSError(errno.ENOSPC, f"SSD tier of tables {tables}: {path} has {free} bytes free, less than one "
                                    f"segment file ({segment_bytes} bytes, StorageConfig.ssd_segment_bytes); "
                                    f"free space there or choose another ssd_dir")


def available_memory_bytes() -> int:
    """Memory this machine can give without swapping (``MemAvailable``), or its RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_dram(dram: Mapping[str, int], owner: str) -> None:
    """Bounded DRAM tiers (in rows of weights and optimizer state) that would not fit in the
    memory available now: an error naming the largest and the numbers."""
    total = sum(dram.values())
    available = available_memory_bytes()
    if total > available:
        largest = sorted(dram, key=dram.get, reverse=True)[:3]
        shares = ", ".join(f"{name!r} {dram[name] / 2**30:.2f} GiB" for name in largest)
        raise MemoryError(f"{owner}: the DRAM tiers of {len(dram)} tables are budgeted {total / 2**30:.2f} GiB "
                          f"(largest: {shares}) but this machine has {available / 2**30:.2f} GiB of memory "
                          f"available (MemAvailable); lower StorageConfig.device_bytes/host_bytes")


def _admission_per_table(value: Admission | Mapping[str, Admission | None] | None,
                         names: list[str], expiry: Mapping[str, Expiry]) -> dict[str, Admission]:
    """Tables a dict leaves out, or names None, admit every id. Each counting table's
    ``halve_every`` is resolved against its ttl (:meth:`Admission.aged_with`)."""
    settings = _settings_per_table(value, names, "admission", Admission, lambda s: s.filters)
    settings = {n: s.aged_with(expiry[n].ttl_steps if n in expiry else None) for n, s in settings.items()}
    for name, setting in settings.items():
        if setting.counts and setting.sketch_bytes < min_sketch_bytes():
            raise ValueError(f"table {name!r}: Admission.sketch_bytes {setting.sketch_bytes} is below the minimum "
                             f"{min_sketch_bytes()} ({PARTITIONS} partitions x {DEPTH} rows x {MIN_WIDTH} counters)")
    return settings


def _settings_per_table(value: Any, names: list[str], what: str, kind: type,
                        acts: Callable[[Any], bool]) -> dict[str, Any]:
    """One setting for every table, or a dict of them by table name; tables a dict leaves
    out, or names None, and settings that do nothing (``acts`` false) are dropped."""
    if value is None:
        return {}
    if isinstance(value, kind):
        value = {n: value for n in names}
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a {kind.__name__} or a dict of them by table, got {value!r}")
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{what}: unknown tables {unknown}; the tables are {names}")
    for name, setting in value.items():
        if setting is not None and not isinstance(setting, kind):
            raise TypeError(f"{what} of table {name!r} must be a {kind.__name__} or None, got {setting!r}")
    return {n: s for n, s in value.items() if s is not None and acts(s)}


def _per_table(value: Any, names: list[str], what: str, kind: type) -> dict[str, Any]:
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        missing = sorted(set(names) - set(value))
        if unknown or missing:
            raise ValueError(f"{what}: unknown tables {unknown}, tables without a setting {missing}")
        return dict(value)
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be a {kind.__name__} or a dict of them, got {value!r}")
    return {n: value for n in names}
