"""How a collection's tables are stored and trained: every setting, checked once."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from ctr_lightning.embedding.optimizers import SparseAdam, SparseOptimizer
from ctr_lightning.embedding.sparse_update import state_width
from ctr_lightning.embedding.storage_config import StorageConfig

KERNELS = ("auto", "numba", "torch")
ID_SPACES = ("hashed", "bounded")


@dataclass(frozen=True)
class TableSetup:
    """How a collection's tables are stored and trained, per table where it differs.

    Made by :meth:`build`, which checks every setting once (storage tiers, id spaces,
    pooling, kernel, SSD directories), so nothing below it checks again. The engines
    take it whole and derive the setups of their parts from it.

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
    module_name: str = "TieredEmbeddingBagCollection"  # named in error messages

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
            module_name=module_name,
        )
        for name, space in setup.id_space.items():
            if space not in ID_SPACES:
                raise ValueError(f"table {name!r}: id_space must be 'hashed' or 'bounded', got {space!r}")
        for t in tables:
            if t.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {t.name!r}: pooling {t.pooling.name} is not supported (SUM or MEAN)")
            if is_weighted and t.pooling != PoolingType.SUM:
                raise ValueError(f"table {t.name!r}: weighted bags need SUM pooling, got {t.pooling.name}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be 'auto', 'numba' or 'torch', got {kernel!r}")
        check_kernel_device(kernel, setup.device)
        for members in setup.groups(tables):
            group = [tables[i] for i in members]
            setup.capacities(group, check=True)
            ssd_dir = setup.storage[group[0].name].ssd_dir
            if ssd_dir is not None:
                _check_directory(ssd_dir, [t.name for t in group])
        return setup

    def row_width(self, dim: int) -> int:
        """Floats stored per row: the weights and the optimizer's state."""
        return dim + state_width(self.optimizer, dim)

    def groups(self, tables: Sequence[EmbeddingBagConfig]) -> list[list[int]]:
        """Indices of the tables that share one set of tiers and kernel calls: same dim,
        pooling, SSD directory and id space."""
        keys: dict[tuple, list[int]] = {}
        for i, t in enumerate(tables):
            keys.setdefault((t.embedding_dim, t.pooling, self.storage[t.name].ssd_dir, self.id_space[t.name]),
                            []).append(i)
        return list(keys.values())

    def capacities(self, group: Sequence[EmbeddingBagConfig],
                   check: bool = False) -> tuple[list[int | None], list[int | None]]:
        """Device and host tier capacities in rows of each table of a group (None:
        unbounded); with ``check``, errors for tiers that cannot work together."""
        row_bytes = self.row_width(group[0].embedding_dim) * 4
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

    def in_memory(self) -> TableSetup:
        """The same, with every table held whole in the device tier."""
        return dataclasses.replace(self, storage={name: StorageConfig() for name in self.storage})


def has_host_tier(device_caps: Sequence[int | None], host_caps: Sequence[int | None]) -> bool:
    """A group has a host tier when its device tier is bounded and a host tier is asked for."""
    return any(c is not None for c in device_caps) and any(c != 0 for c in host_caps)


def check_kernel_device(kernel: str, device: torch.device) -> None:
    if kernel == "numba" and device.type != "cpu":
        raise ValueError(f"kernel='numba' needs the device tier in CPU memory, not on {device}")


def _check_directory(path: str, tables: list[str]) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"SSD tier of tables {tables}: cannot create files in {path}: {e.strerror}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"SSD tier of tables {tables}: cannot create files in {path}: not writable")


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
