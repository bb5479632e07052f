"""A drifting hourly log written on first use and followed hour by hour: the online demo's data."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

from ctr_lightning.datamodules.criteo import CriteoDataModule
from ctr_lightning.datamodules.drifting_log import DriftingLog


class DriftingLogDataModule(CriteoDataModule):
    """Writes ``days`` days of a :class:`DriftingLog` (ids born and fading, click rates
    drifting) under ``data_dir`` in ``prepare_data``, as Hive partitions with ``_SUCCESS``
    markers, then trains them in ``follow`` mode, one hour an epoch, in time order; the run
    ends once no hour is left (``idle_timeout`` seconds after the last). Hours written by an
    earlier run with the same parameters are reused.

    Args:
        data_dir: where the partitions go (git-ignored ``data/`` by default).
        days: days of the log.
        hours_per_day: hourly partitions a day (1 to 24).
        rows_per_hour: examples in each hour's file.
        new_id_share: share of each day's ids never seen before.
        popularity_decay: the factor an id cohort's popularity keeps from one day to the next.
        drift_share: share of the ids that take a new click rate each day.
        cohort_size: ids born together (one cohort a day ages as one).
        seed: the planted world.
        batch_size: examples per batch.
        num_workers: DataLoader worker processes per rank.
        poll_seconds: how often follow mode looks for the next hour.
        idle_timeout: seconds without a new hour after which the run ends.

    Example::

        dm = DriftingLogDataModule(days=30, rows_per_hour=2048, batch_size=2048)
        Trainer(reload_dataloaders_every_n_epochs=1, max_epochs=-1).fit(DLRMModule(expiry=Expiry(ttl=72)), datamodule=dm)
    """

    def __init__(self, data_dir: str = "data/drifting_log", days: int = 30, hours_per_day: int = 24,
                 rows_per_hour: int = 2048, new_id_share: float = 0.2, popularity_decay: float = 0.7,
                 drift_share: float = 0.1, cohort_size: int = 5000, seed: int = 0, batch_size: int = 2048,
                 num_workers: int = 0, poll_seconds: float = 0.2, idle_timeout: float = 1.0) -> None:
        if days < 1 or not 1 <= hours_per_day <= 24:
            raise ValueError(f"days must be >= 1 and hours_per_day in [1, 24], got {days}, {hours_per_day}")
        self.log = DriftingLog(seed=seed, rows_per_hour=rows_per_hour, new_id_share=new_id_share,
                               popularity_decay=popularity_decay, drift_share=drift_share, cohort_size=cohort_size)
        self.root = Path(data_dir) / (f"seed{seed}-rows{rows_per_hour}-new{new_id_share:g}-decay{popularity_decay:g}"
                                      f"-drift{drift_share:g}-cohort{cohort_size}")
        self.days, self.hours_per_day = days, hours_per_day
        super().__init__(train_paths=str(self.root), batch_size=batch_size, num_workers=num_workers, follow=True,
                         poll_seconds=poll_seconds, idle_timeout=idle_timeout, partition_time=True)
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        rank_zero_info(f"Writing {self.days} days of a drifting hourly log to {self.root} (hours written before "
                       f"are kept) ...")
        self.log.write(self.root, self.days, self.hours_per_day)
