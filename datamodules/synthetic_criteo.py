"""Synthetic ad logs in the Criteo raw layout, with a planted click model.

The generator mimics the statistics that make Criteo hard: 26 categorical features
with the public Criteo Kaggle cardinalities (capped by ``max_cardinality``),
Zipf-skewed value frequencies, 13 heavy-tailed counts, and missing fields at the
rates seen in the real logs. Labels come from a planted logistic model: a random
effect per (feature, value), a few low-rank pairwise interactions, and small
effects of the counts. Rare values carry effects too, so, as in real logs, part of
the signal is only learnable for frequent values.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from ctr_lightning.datamodules.criteo_schema import DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from ctr_lightning.hashing import mix32, splitmix64, unit_variance, uniform01
from ctr_lightning.synthetic_criteo_spec import SyntheticCriteoSpec

# Distinct values per feature in the Criteo Kaggle (Display Advertising Challenge) train set.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# Missing-field rates of I1..I13 and C1..C26 as observed in the Kaggle train set.
_DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.23, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22)
_SPARSE_MISSING = (
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0,
    0.0, 0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.77, 0.0, 0.03, 0.44, 0.44,
)
# C19, C20, C25 and C26 go missing together in the real logs.
_MISSING_TOGETHER = (18, 19, 24, 25)
# Median and 90th percentile of each count, from the same logs (lognormal fit).
_DENSE_MEDIAN = (1, 3, 6, 4, 2800, 31, 3, 7, 38, 1, 1, 0, 4)
_DENSE_P90 = (10, 180, 43, 18, 31600, 256, 35, 34, 257, 1, 6, 1, 20)


_CHUNK_ROWS = 1 << 16
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NIBBLE_SHIFTS = np.arange(28, -1, -4, dtype=np.uint32)


@dataclass
class SyntheticChunk:
    """One generated block of rows: the Arrow table to write and the planted truth."""

    table: pa.Table
    ranks: np.ndarray  # [rows, 26] int64 value rank per feature, -1 where missing
    logits: np.ndarray  # [rows] planted click logit


class SyntheticCriteo:
    """Generates rows of a :class:`SyntheticCriteoSpec` world, block by block.

    Block ``i`` depends only on (seed, i), so a file of N rows is a prefix of a
    file of M > N rows with the same seed.

    Example::

        gen = SyntheticCriteo(SyntheticCriteoSpec(seed=0))
        chunk = gen.chunk(0, rows=1000)   # table, ranks, planted logits
    """

    def __init__(self, spec: SyntheticCriteoSpec) -> None:
        self.spec = spec
        self.cardinalities = np.minimum(np.array(CRITEO_KAGGLE_CARDINALITIES), spec.max_cardinality)
        key = lambda *parts: self._key(*parts)  # noqa: E731
        # Feature strength in [0, 1): squared so that a few features dominate, as in real logs.
        self._feature_scale = uniform01(key(1, np.arange(NUM_SPARSE))) ** 2 * spec.value_effect_scale
        self._missing_effect = 0.3 * unit_variance(key(2, np.arange(NUM_SPARSE)))
        self._dense_weight = 0.25 * unit_variance(key(3, np.arange(NUM_DENSE)))
        self._dense_missing_effect = 0.2 * unit_variance(key(4, np.arange(NUM_DENSE)))
        # Interactions join features of moderate cardinality, whose pairs recur often enough to learn.
        order = np.argsort(uniform01(key(5, np.arange(NUM_SPARSE * NUM_SPARSE))))
        pairs: list[tuple[int, int]] = []
        for flat in order:
            a, b = divmod(int(flat), NUM_SPARSE)
            if a < b and 3 <= self.cardinalities[a] and 3 <= self.cardinalities[b] and len(pairs) < spec.num_interactions:
                pairs.append((a, b))
        self.interactions = tuple(pairs)
        mu = np.log1p(np.array(_DENSE_MEDIAN, dtype=np.float64))
        self._dense_mu = mu
        self._dense_sigma = np.maximum(np.log1p(np.array(_DENSE_P90, dtype=np.float64)) - mu, 0.3) / 1.2816

    def _key(self, *parts: int | np.ndarray) -> np.ndarray:
        h = splitmix64(np.uint64(self.spec.seed & 0xFFFFFFFFFFFFFFFF))
        for p in parts:
            h = splitmix64(h ^ np.asarray(p, dtype=np.uint64))
        return h

    @cached_property
    def bias(self) -> float:
        """Intercept that makes the mean click probability equal ``spec.click_rate``."""
        logits = np.concatenate([self._raw_logits(self._rng(i, stream=-1), _CHUNK_ROWS)[1] for i in range(4)])
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if (1.0 / (1.0 + np.exp(-(logits + mid)))).mean() < self.spec.click_rate:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def _rng(self, block: int, stream: int = 0) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64([self.spec.seed & 0xFFFFFFFF, stream & 0xFFFFFFFF, block & 0xFFFFFFFFFFFF]))

    def _raw_logits(self, rng: np.random.Generator, rows: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        s = self.spec.zipf_exponent
        # Inverse CDF of a continuous power law on [1, N+1); floor gives a Zipf-like rank.
        u = rng.random((rows, NUM_SPARSE))
        n1 = (self.cardinalities + 1).astype(np.float64)
        if abs(s - 1.0) < 1e-9:
            x = np.exp(u * np.log(n1))
        else:
            x = ((n1 ** (1.0 - s) - 1.0) * u + 1.0) ** (1.0 / (1.0 - s))
        ranks = np.minimum(np.floor(x).astype(np.int64) - 1, self.cardinalities - 1)
        miss_u = rng.random((rows, NUM_SPARSE))
        miss_u[:, list(_MISSING_TOGETHER)] = miss_u[:, [_MISSING_TOGETHER[0]]]
        sparse_missing = miss_u < np.array(_SPARSE_MISSING)
        ranks[sparse_missing] = -1

        z = rng.standard_normal((rows, NUM_DENSE))
        dense_missing = rng.random((rows, NUM_DENSE)) < np.array(_DENSE_MISSING)

        logits = np.zeros(rows)
        f_idx = np.arange(NUM_SPARSE, dtype=np.uint64)
        effects = unit_variance(self._key(6, f_idx[None, :], ranks.astype(np.uint64)))
        logits += np.where(sparse_missing, self._missing_effect, effects * self._feature_scale).sum(axis=1)
        k = np.arange(self.spec.interaction_rank, dtype=np.uint64)
        for a, b in self.interactions:
            ua = unit_variance(self._key(7, a, ranks[:, a : a + 1].astype(np.uint64), k))
            vb = unit_variance(self._key(8, b, ranks[:, b : b + 1].astype(np.uint64), k))
            term = (ua * vb).sum(axis=1) / np.sqrt(self.spec.interaction_rank)
            logits += np.where(sparse_missing[:, a] | sparse_missing[:, b], 0.0, term)
        logits += np.where(dense_missing, self._dense_missing_effect, z * self._dense_weight).sum(axis=1)
        return {"ranks": ranks, "z": z, "dense_missing": dense_missing}, logits

    def chunk(self, block: int, rows: int = _CHUNK_ROWS, stream: int = 0) -> SyntheticChunk:
        """Generate block ``block`` of row stream ``stream`` (its first ``rows`` rows).

        Streams are independent samples of the same world: e.g. one per day of logs.
        """
        rng = self._rng(block, stream)
        parts, logits = self._raw_logits(rng, _CHUNK_ROWS)
        parts = {k: v[:rows] for k, v in parts.items()}
        logits = logits[:rows] + self.bias
        labels = (rng.random(_CHUNK_ROWS)[:rows] < 1.0 / (1.0 + np.exp(-logits))).astype(np.int8)

        columns: dict[str, pa.Array] = {"label": pa.array(labels)}
        counts = np.floor(np.expm1(self._dense_mu + self._dense_sigma * parts["z"])).astype(np.int64)
        # The real I2 holds a few small negative values.
        counts[:, 1] = np.where(rng.random(_CHUNK_ROWS)[:rows] < 0.02, -rng.integers(1, 4, _CHUNK_ROWS)[:rows], counts[:, 1])
        for j, name in enumerate(DENSE_NAMES):
            columns[name] = pa.array(counts[:, j], mask=parts["dense_missing"][:, j])
        ranks = parts["ranks"]
        for f, name in enumerate(SPARSE_NAMES):
            columns[name] = self._hex_column(f, ranks[:, f])
        return SyntheticChunk(table=pa.table(columns), ranks=ranks, logits=logits)

    def values(self, feature: int, ranks: np.ndarray) -> np.ndarray:
        """The 32-bit categorical value of each rank: a keyed bijection, so no two ranks collide."""
        return mix32(np.asarray(ranks, dtype=np.uint64) ^ (self._key(9, feature) & np.uint64(0xFFFFFFFF)))

    def _hex_column(self, feature: int, ranks: np.ndarray) -> pa.Array:
        missing = ranks < 0
        v = self.values(feature, np.maximum(ranks, 0)).astype(np.uint32)
        chars = _HEX[(v[:, None] >> _NIBBLE_SHIFTS) & 0xF]  # [rows, 8] ASCII
        n = len(ranks)
        offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
        validity = pa.array(~missing).buffers()[1] if missing.any() else None
        return pa.StringArray.from_buffers(
            n, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(chars)), validity,
            int(missing.sum()),
        )

    def write(self, path: str | Path, rows: int, stream: int = 0) -> Path:
        """Write ``rows`` rows of ``stream`` to ``path`` (tab-separated; gzip when it ends in ``.gz``)."""
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
        sink = pa.CompressedOutputStream(str(tmp), "gzip") if path.suffix == ".gz" else pa.OSFile(str(tmp), "wb")
        schema = self.chunk(0, 0).table.schema
        sizes = [min(_CHUNK_ROWS, rows - start) for start in range(0, rows, _CHUNK_ROWS)]
        # numpy and Arrow release the GIL, so blocks generate on a second core while one is written.
        with (ThreadPoolExecutor(max_workers=2) as pool, sink,
              pacsv.CSVWriter(sink, schema, write_options=options) as writer):
            pending: deque[Future[SyntheticChunk]] = deque()
            for block, size in enumerate(sizes):
                pending.append(pool.submit(self.chunk, block, size, stream))
                if len(pending) > 2:  # bounded look-ahead keeps memory flat for any row count
                    writer.write_table(pending.popleft().result().table)
            while pending:
                writer.write_table(pending.popleft().result().table)
        # Rename last, so an interrupted run never leaves a truncated file under the real name.
        tmp.replace(path)
        return path


def write_synthetic_criteo(
    path: str | Path,
    rows: int,
    seed: int = 0,
    *,
    stream: int = 0,
    max_cardinality: int = 1_000_000,
    zipf_exponent: float = 1.1,
    click_rate: float = 0.25,
) -> Path:
    """Write ``rows`` synthetic examples in the Criteo raw layout to ``path``.

    ``seed`` fixes the planted world; ``stream`` picks an independent sample of it, so
    a train and a validation file share one click model but no rows.

    Example::

        write_synthetic_criteo("data/demo/train.tsv", rows=200_000, seed=0)
        write_synthetic_criteo("data/demo/val.tsv", rows=50_000, seed=0, stream=1)
    """
    spec = SyntheticCriteoSpec(seed=seed, max_cardinality=max_cardinality,
                               zipf_exponent=zipf_exponent, click_rate=click_rate)
    return SyntheticCriteo(spec).write(path, rows, stream)
