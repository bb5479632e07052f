"""Where a table's rows live: capacities of the device and host tiers, the SSD directory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.checkpoint_safe import checkpoint_safe

Eviction = Literal["lru", "lfu"]


@checkpoint_safe
@dataclass(frozen=True)
class StorageConfig:
    """Tier capacities of one table (or of every table, when given once).

    Each capacity may be given in rows, in bytes, or both (the smaller wins); ``None``
    means the tier holds every row it is given. A bounded host tier needs ``ssd_dir``,
    where the rows that do not fit are kept in files. A host capacity of 0 means no
    host tier: rows leaving the device tier go straight to SSD (the natural choice on a
    CPU machine, where the device tier is DRAM already).

    Args:
        device_rows / device_bytes: the tier the compute reads (GPU memory, or DRAM on CPU).
        host_rows / host_bytes: the DRAM cache below it.
        ssd_dir: directory for the SSD tier's files.
        eviction: ``"lru"`` or ``"lfu"``, for both caches.
        ssd_segment_bytes: size of each file of the SSD log (tables with hashed ids); the
            log is cleaned a file at a time.

    Example::

        StorageConfig(device_rows=100_000, host_bytes=2 << 30, ssd_dir="/nvme/run1", eviction="lru")
    """

    device_rows: int | None = None
    device_bytes: int | None = None
    host_rows: int | None = None
    host_bytes: int | None = None
    ssd_dir: str | None = None
    eviction: Eviction = "lru"
    ssd_segment_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in ("device_rows", "device_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"StorageConfig.{name} must be >= 1 or None, got {value}")
        for name in ("host_rows", "host_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"StorageConfig.{name} must be >= 0 or None, got {value}")
        if self.ssd_segment_bytes < 1:
            raise ValueError(f"StorageConfig.ssd_segment_bytes must be >= 1, got {self.ssd_segment_bytes}")
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"StorageConfig.eviction must be 'lru' or 'lfu', got {self.eviction!r}")

    def device_capacity(self, row_bytes: int) -> int | None:
        return _capacity(self.device_rows, self.device_bytes, row_bytes)

    def host_capacity(self, row_bytes: int) -> int | None:
        return _capacity(self.host_rows, self.host_bytes, row_bytes)


@checkpoint_safe
@dataclass(frozen=True)
class AutoStorage:
    """Tier budgets planned from the machine (``storage: auto``): at set-up each rank
    reads the topology, takes its share of free GPU memory and DRAM and an SSD directory
    near it, and splits them over the tables by their access skew
    (:func:`ctr_lightning.topology.plan`).

    Args:
        ssd_dirs: directories the SSD tiers may use; several spread the ranks over drives
            (nearest first). Empty: ``ctr-lightning-ssd`` on each writable drive.
        dram_fraction / hbm_fraction: share of the free DRAM (of the rank's NUMA node)
            and GPU memory the tiers may take.
        reserve_bytes: memory each rank keeps outside its tiers.
        profile_batches: count ids over the data's first batches to measure each table's
            skew (0: assume Zipf 1.05 over ``num_embeddings``).

    Example::

        TieredEmbeddingBagCollection(tables, storage=AutoStorage(ssd_dirs=("/nvme0/run", "/nvme1/run")))
    """

    ssd_dirs: tuple[str, ...] = ()
    dram_fraction: float = 0.5
    hbm_fraction: float = 0.7
    reserve_bytes: int = 2 << 30
    profile_batches: int = 0

    def __post_init__(self) -> None:
        for name in ("dram_fraction", "hbm_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"AutoStorage.{name} must be in (0, 1], got {value}")
        if self.reserve_bytes < 0 or self.profile_batches < 0:
            raise ValueError(f"AutoStorage.reserve_bytes and profile_batches must be >= 0, got "
                             f"{self.reserve_bytes}, {self.profile_batches}")
        object.__setattr__(self, "ssd_dirs", tuple(self.ssd_dirs))


def _capacity(rows: int | None, nbytes: int | None, row_bytes: int) -> int | None:
    limits = [x for x in (rows, None if nbytes is None else nbytes // row_bytes) if x is not None]
    return min(limits) if limits else None


def plan_storage(
    tables: Sequence[EmbeddingBagConfig],
    device_bytes: int | None = None,
    host_bytes: int | None = None,
    ssd_dir: str | None = None,
    eviction: Eviction = "lru",
) -> dict[str, StorageConfig]:
    """Split per-tier byte budgets over tables in proportion to their sizes.

    A table's size is ``num_embeddings * embedding_dim``; a table never gets more than
    it can use.

    Example::

        storage = plan_storage(tables, device_bytes=1 << 30, host_bytes=8 << 30, ssd_dir="/nvme/run1")
        TieredEmbeddingBagCollection(tables, storage=storage)
    """
    sizes = [t.num_embeddings * t.embedding_dim for t in tables]
    total = sum(sizes)

    def share(budget: int | None, size: int) -> int | None:
        return None if budget is None else max(1, budget * size // total)

    return {
        t.name: StorageConfig(device_bytes=share(device_bytes, s), host_bytes=share(host_bytes, s),
                              ssd_dir=ssd_dir, eviction=eviction)
        for t, s in zip(tables, sizes)
    }
