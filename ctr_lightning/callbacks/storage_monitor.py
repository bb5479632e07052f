"""What the tiered tables hold, on the progress bar and in TensorBoard, and a run's stop by size."""

from __future__ import annotations

import os
import shutil
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ctr_lightning.callbacks.tiered_collections import tiered_collections
from ctr_lightning.embedding.counters import sum_counters
from ctr_lightning.embedding.tiered import TieredEmbeddingBagCollection


def physical_memory_bytes() -> int:
    """The machine's RAM (``MemTotal``)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resident_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def parse_size(size: int | float | str) -> int:
    """Bytes from ``12345``, ``"36GB"``, ``"512MiB"`` or ``"1.5xRAM"`` (times physical memory)."""
    if isinstance(size, (int, float)):
        return int(size)
    text = size.strip().lower().replace(" ", "")
    if text.endswith("xram"):
        return int(float(text[:-4]) * physical_memory_bytes())
    units = {"tib": 1 << 40, "gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10, "tb": 10**12, "gb": 10**9, "mb": 10**6,
             "kb": 10**3, "b": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(float(text))


class StorageMonitor(Callback):
    """Logs what the LightningModule's tiered tables hold, and can stop the run at a size.

    Every ``every_n_steps`` steps (summed over its collections, this rank):
    ``storage/ssd_bytes`` (the SSD files), ``storage/ssd_live_bytes``, ``storage/rows``
    (rows stored, all tiers), ``storage/dram_bytes`` (memory tiers with their bookkeeping
    and the SSD index), ``storage/index_bytes_per_row`` (the SSD index per row stored
    there) and ``storage/rss_bytes``; rows and SSD GiB also on the progress bar. Where
    tables admit ids selectively: ``storage/rows_admitted`` and ``storage/rows_rejected``
    (so far), and per table ``storage/admitted/<table>`` and ``storage/rejected/<table>``;
    where they count sightings, ``storage/sketch_fill/<table>``, the share of the sketch's
    counters in use (this rank's; far over half, ids seen once get rows: see
    ``Admission.halve_every``).
    Where tables expire rows: ``storage/rows_expired`` (by ttl) and ``storage/rows_evicted``
    (by max_rows) so far, and per table ``storage/live_rows/<table>`` (rows stored now),
    ``storage/expired/<table>`` and ``storage/evicted/<table>``.

    With ``stop_at_ssd_bytes`` (bytes, or a string such as ``"36GB"`` or ``"1.5xRAM"``),
    training stops once the live rows on SSD reach it, and before training starts the SSD
    directories are checked to hold that much with the log's garbage allowance
    (``(1 + garbage) *`` the size, plus ``slack_bytes``): a run that could not finish
    stops at once, naming the directory and the numbers.

    Example::

        Trainer(callbacks=[StorageMonitor(every_n_steps=20, stop_at_ssd_bytes="1.5xRAM")])
    """

    def __init__(self, every_n_steps: int = 20, stop_at_ssd_bytes: int | str | None = None,
                 garbage: float = 0.3, slack_bytes: int | str = "2GiB") -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.stop_at = parse_size(stop_at_ssd_bytes) if stop_at_ssd_bytes is not None else None
        self.garbage = garbage
        self.slack = parse_size(slack_bytes)
        self._collections: list[TieredEmbeddingBagCollection] = []
        self.last: dict[str, float] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._collections = tiered_collections(pl_module, "StorageMonitor")
        if self.stop_at is None or stage != "fit":
            return
        if not any(c.auto_storage is not None for c in self._collections):
            self._check_disk()
        # Under storage auto the SSD directories are known once the tiers are planned, at the
        # start of fit on the module's device (asking now would plan them here): on_train_start.

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stop_at is not None and any(c.auto_storage is not None for c in self._collections):
            self._check_disk()

    def _check_disk(self) -> None:
        directories = sorted({d for c in self._collections for d in c.ssd_directories})
        if not directories:
            raise ValueError(f"StorageMonitor(stop_at_ssd_bytes={self.stop_at}): the tables have no SSD tier "
                             f"(StorageConfig.ssd_dir); they would have to hold every row in memory")
        need = int(self.stop_at * (1 + self.garbage)) + self.slack
        for directory in directories:
            os.makedirs(directory, exist_ok=True)
            free = shutil.disk_usage(directory).free
            if free < need:
                raise ValueError(
                    f"SSD directory {directory} has {free / 2**30:.1f} GiB free, but this run stores "
                    f"{self.stop_at / 2**30:.1f} GiB of rows there and needs about {need / 2**30:.1f} GiB with the "
                    f"log's garbage ({self.garbage:.0%}) and {self.slack / 2**30:.1f} GiB of slack; free space, "
                    f"point StorageConfig.ssd_dir elsewhere, or lower stop_at_ssd_bytes")
        rank_zero_info(f"StorageMonitor: stops once {self.stop_at / 2**30:.1f} GiB of rows are on SSD "
                       f"({', '.join(directories)}: about {need / 2**30:.1f} GiB of disk needed)")

    def storage(self) -> dict[str, float]:
        total = sum_counters(c.storage_stats() for c in self._collections)
        rows = total["ssd_rows"] + total["memory_rows"]
        return {"storage/ssd_bytes": float(total["ssd_bytes"]), "storage/ssd_live_bytes": float(total["ssd_live_bytes"]),
                "storage/rows": float(rows), "storage/dram_bytes": float(total["dram_bytes"]),
                "storage/index_bytes_per_row": total["ssd_index_bytes"] / max(total["ssd_rows"], 1),
                "storage/rss_bytes": float(resident_bytes()), **self._admission(), **self._expiry()}

    def _admission(self) -> dict[str, float]:
        per_table = {name: c for collection in self._collections for name, c in collection.admission_counts().items()}
        out = _table_counts(per_table, {"admitted": "rows_admitted", "rejected": "rows_rejected"},
                            {"admitted": "admitted", "rejected": "rejected"})
        out.update({f"storage/sketch_fill/{table}": c["counters_used"] / c["counters"]
                    for table, c in per_table.items() if c.get("counters")})
        return out

    def _expiry(self) -> dict[str, float]:
        per_table = {name: c for collection in self._collections for name, c in collection.expiry_counts().items()}
        return _table_counts(per_table, {"expired": "rows_expired", "evicted": "rows_evicted"},
                             {"rows": "live_rows", "expired": "expired", "evicted": "evicted"})

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        self.last = self.storage()
        for logger in trainer.loggers:
            logger.log_metrics(self.last, step=trainer.global_step)
        pl_module.log("rows_M", self.last["storage/rows"] / 1e6, prog_bar=True, on_step=True, on_epoch=False,
                      logger=False)
        pl_module.log("ssd_GiB", self.last["storage/ssd_bytes"] / 2**30, prog_bar=True, on_step=True, on_epoch=False,
                      logger=False)
        if self.stop_at is not None:
            # Every rank checks its own shard; they stop together (a collective, every n steps).
            reached = self.last["storage/ssd_live_bytes"] >= self.stop_at
            if trainer.strategy.reduce_boolean_decision(reached, all=False):
                rank_zero_info(f"StorageMonitor: {self.last['storage/ssd_live_bytes'] / 2**30:.1f} GiB of rows on "
                               f"SSD, the run's size: stopping")
                trainer.should_stop = True


def _table_counts(per_table: dict[str, dict[str, int]], totals: dict[str, str],
                  each: dict[str, str]) -> dict[str, float]:
    """``storage/<total>`` summed over the tables and ``storage/<name>/<table>`` per table,
    from per-table counts (none: nothing logged)."""
    if not per_table:
        return {}
    out = {f"storage/{total}": float(sum(c[key] for c in per_table.values())) for key, total in totals.items()}
    for table, counts in per_table.items():
        out.update({f"storage/{name}/{table}": float(counts[key]) for key, name in each.items()})
    return out
