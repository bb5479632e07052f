"""Hourly ad logs in the Criteo layout whose ids come and go and whose click rates drift:
the workload of a model that trains online for weeks.

Each day a new cohort of ids is born per feature. A lookup is an id of today's cohort with
probability ``new_id_share`` (so that share of a day's ids were never seen before), else an
id of a cohort ``a`` days old, ``a`` drawn with probability falling as ``popularity_decay ** a``
(old ids fade away); within a cohort ids are Zipf-skewed. Clicks follow a planted logistic
model of per-id effects, and each day a share ``drift_share`` of the ids takes a new effect
(their click rates drift). The log is written as Hive partitions,
``dt=YYYY-MM-DD/hour=HH/part-00000.tsv`` with a ``_SUCCESS`` marker, as a log lands, so
``follow`` mode trains it hour by hour. Hour ``(day, hour)`` depends only on ``(seed, day, hour)``.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from ctr_lightning.datamodules.criteo_schema import DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from ctr_lightning.hashing import mix32, splitmix64, unit_variance

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NIBBLE_SHIFTS = np.arange(28, -1, -4, dtype=np.uint32)
_START = dt.date(2026, 11, 1)


def partition(day: int, hour: int) -> str:
    """The Hive partition of an hour of the log: ``dt=2026-11-01/hour=00`` for (0, 0)."""
    return f"dt={(_START + dt.timedelta(days=day)).isoformat()}/hour={hour:02d}"


class DriftingLog:
    """The hours of one drifting log (see the module).

    Example::

        log = DriftingLog(seed=0, rows_per_hour=2048)
        log.write_hour("data/online", day=3, hour=17)   # dt=2026-11-04/hour=17/part-00000.tsv
    """

    def __init__(self, seed: int = 0, rows_per_hour: int = 2048, new_id_share: float = 0.2,
                 popularity_decay: float = 0.7, drift_share: float = 0.1, cohort_size: int = 5000,
                 zipf_exponent: float = 1.1) -> None:
        if not 0.0 <= new_id_share <= 1.0 or not 0.0 < popularity_decay < 1.0 or not 0.0 < drift_share <= 1.0:
            raise ValueError(f"DriftingLog: new_id_share must be in [0, 1], popularity_decay in (0, 1) and "
                             f"drift_share in (0, 1]; got {new_id_share}, {popularity_decay}, {drift_share}")
        if rows_per_hour < 1 or cohort_size < 1:
            raise ValueError(f"DriftingLog: rows_per_hour and cohort_size must be >= 1, got {rows_per_hour}, "
                             f"{cohort_size}")
        self.seed, self.rows_per_hour = seed, rows_per_hour
        self.new_id_share, self.popularity_decay, self.drift_share = new_id_share, popularity_decay, drift_share
        self.cohort_size, self.zipf_exponent = cohort_size, zipf_exponent
        self.period = max(1, round(1 / drift_share))  # an id's effect changes every `period` days
        key = splitmix64(np.uint64(seed) ^ np.uint64(0x5EED))
        self._feature_scale = 0.5 + np.abs(unit_variance(splitmix64(key + np.arange(NUM_SPARSE, dtype=np.uint64))))

    def rows(self, day: int, hour: int) -> tuple[pa.Table, np.ndarray]:
        """``(table, logits)``: the hour's rows in the Criteo layout and their planted click logits."""
        n = self.rows_per_hour
        rng = np.random.Generator(np.random.PCG64([self.seed & 0xFFFFFFFF, day, hour]))
        new = rng.random((n, NUM_SPARSE)) < self.new_id_share
        age = rng.geometric(1.0 - self.popularity_decay, (n, NUM_SPARSE))  # 1, 2, ... days, fading
        cohort = np.where(new, day, day - age).astype(np.int64)
        s, top = self.zipf_exponent, float(self.cohort_size + 1)
        u = rng.random((n, NUM_SPARSE))
        rank = np.minimum(np.floor(((top ** (1 - s) - 1) * u + 1) ** (1 / (1 - s))).astype(np.int64) - 1,
                          self.cohort_size - 1)
        feature = np.arange(NUM_SPARSE, dtype=np.uint64)
        item = (splitmix64((cohort.astype(np.uint64) << np.uint64(24)) ^ rank.astype(np.uint64)
                           ^ (feature << np.uint64(56)) ^ np.uint64(self.seed)))
        # Each id's effect changes every `period` days, the ids out of step: a share
        # 1 / period of them drifts each day.
        phase = (item >> np.uint64(40)) % np.uint64(self.period)
        version = (np.uint64(day) + phase) // np.uint64(self.period)
        effect = unit_variance(splitmix64(item ^ (version * np.uint64(0x9E3779B97F4A7C15))))
        counts = rng.poisson(3.0, (n, NUM_DENSE)).astype(np.int64)
        logits = -1.4 + 0.9 * (effect * self._feature_scale).sum(axis=1) / np.sqrt(NUM_SPARSE) \
            + 0.2 * (counts[:, 0] - 3.0) / np.sqrt(3.0)
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int8)
        columns: dict[str, pa.Array] = {"label": pa.array(labels)}
        for j, name in enumerate(DENSE_NAMES):
            columns[name] = pa.array(counts[:, j])
        values = mix32(item).astype(np.uint32)
        for f, name in enumerate(SPARSE_NAMES):
            chars = _HEX[(values[:, f, None] >> _NIBBLE_SHIFTS) & 0xF]
            offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
            columns[name] = pa.StringArray.from_buffers(n, pa.py_buffer(offsets),
                                                        pa.py_buffer(np.ascontiguousarray(chars)))
        return pa.table(columns), logits

    def write_hour(self, root: str | Path, day: int, hour: int) -> Path:
        """Write one hour's partition (file, then its ``_SUCCESS`` marker); an hour written
        already is left as it is. Returns the partition's directory."""
        directory = Path(root) / partition(day, hour)
        if (directory / "_SUCCESS").exists():
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        table, _ = self.rows(day, hour)
        tmp = directory / ".part-00000.tsv.partial"
        options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
        pacsv.write_csv(table, str(tmp), write_options=options)
        tmp.replace(directory / "part-00000.tsv")
        (directory / "_SUCCESS").touch()
        return directory

    def write(self, root: str | Path, days: int, hours_per_day: int = 24) -> list[Path]:
        """Write ``days`` days of ``hours_per_day`` hours each; returns the partitions in order."""
        return [self.write_hour(root, day, hour) for day in range(days) for hour in range(hours_per_day)]
