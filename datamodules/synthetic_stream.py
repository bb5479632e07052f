"""An endless ad-log stream whose tables keep growing, generated on the fly: the workload of
tables larger than memory.

Each lookup is either one of a feature's popular ids (a Zipf-skewed head, as ads, users
and queries recur) or, with probability ``new_id_fraction``, an id never seen before (new
ads, users, queries), so the tables grow for as long as training runs, as production
ones do. Clicks follow a planted logistic model of the head ids and one dense feature.
Batch ``b`` of a stream is a function of (seed, stream, b) alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ctr_lightning.batch import Batch
from ctr_lightning.datamodules.log_format import DecodedRows
from ctr_lightning.datamodules.wire import RawBatch, _Ones
from ctr_lightning.hashing import feature_ids, splitmix64, unit_variance

_NEW = np.uint64(1) << np.uint64(62)  # new ids live above every head id's raw value


class SyntheticStream(IterableDataset):
    """Batches ``[first, first + batches)`` of one rank's share of a growing-id stream.

    Example::

        stream = SyntheticStream(num_sparse=26, num_dense=13, batch_size=4096, batches=100)
        loader = StreamLoader(stream, num_workers=1)
    """

    def __init__(self, num_sparse: int, num_dense: int, batch_size: int, batches: int, head_size: int = 1_000_000,
                 zipf_exponent: float = 1.05, new_id_fraction: float = 0.2, seed: int = 0, stream: int = 0,
                 rank: int = 0, world_size: int = 1, first: int = 0) -> None:
        super().__init__()
        if not 0.0 <= new_id_fraction <= 1.0:
            raise ValueError(f"new_id_fraction must be in [0, 1], got {new_id_fraction}")
        if head_size < 1 or zipf_exponent <= 0:
            raise ValueError(f"head_size must be >= 1 and zipf_exponent > 0, got {head_size}, {zipf_exponent}")
        self.num_sparse, self.num_dense, self.batch_size = num_sparse, num_dense, batch_size
        self.batches, self.first = batches, first
        self.head_size, self.zipf_exponent, self.new_id_fraction = head_size, zipf_exponent, new_id_fraction
        self.seed, self.stream, self.rank, self.world_size = seed, stream, rank, world_size
        self.sparse_feature_names = tuple(f"C{i}" for i in range(1, num_sparse + 1))

    def rows(self, batch: int) -> DecodedRows:
        """Global batch ``batch`` of this stream (every rank's batches interleave: b * world + rank)."""
        n, f = self.batch_size, self.num_sparse
        number = batch * self.world_size + self.rank
        rng = np.random.Generator(np.random.PCG64([self.seed & 0xFFFFFFFF, self.stream & 0xFFFF, number]))
        # A bounded Zipf rank by the inverse CDF of a continuous power law, floored.
        s, top = self.zipf_exponent, float(self.head_size + 1)
        u = rng.random((n, f))
        x = np.exp(u * np.log(top)) if abs(s - 1.0) < 1e-9 else ((top ** (1 - s) - 1) * u + 1) ** (1 / (1 - s))
        ranks = np.minimum(np.floor(x).astype(np.int64) - 1, self.head_size - 1).astype(np.uint64)
        new = rng.random((n, f)) < self.new_id_fraction
        # A new id is unique to its (stream, batch, row): never seen before, never again.
        fresh = _NEW | (np.uint64(self.stream) << np.uint64(56)) | (np.uint64(number) * np.uint64(n)
                                                                    + np.arange(n, dtype=np.uint64))[:, None]
        raw = np.where(new, fresh, ranks)
        ids = np.stack([feature_ids(raw[:, k], k) for k in range(f)], axis=1)
        dense = rng.standard_normal((n, self.num_dense)).astype(np.float32)
        effect = unit_variance(splitmix64((np.uint64(self.seed) << np.uint64(32)) ^ raw.astype(np.uint64)))
        logit = -1.2 + 0.8 * np.where(new, 0.0, effect).sum(axis=1) / np.sqrt(f) + 0.3 * dense[:, 0]
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return DecodedRows(labels=labels, dense=dense, ids=ids, problems=[])

    def __iter__(self) -> Iterator[RawBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for batch in range(self.first + worker, self.first + self.batches, workers):
            yield RawBatch.pack([self.rows(batch)], shard=worker)


class StreamLoader(DataLoader):
    """A DataLoader of :class:`SyntheticStream` batches, as :class:`Batch` es."""

    def __init__(self, dataset: SyntheticStream, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=None, **kwargs)
        self._ones = _Ones()

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        keys = list(self.dataset.sparse_feature_names)
        for raw in super().__iter__():
            yield from RawBatch(*raw).to_batches(keys, self._ones)

    def __len__(self) -> int:
        return self.dataset.batches


class SyntheticStreamDataModule(pl.LightningDataModule):
    """Train and validation streams of ever-growing tables (see :mod:`synthetic_stream`).

    Args:
        num_sparse: categorical features (26, as the Criteo layout's, by default).
        num_dense: continuous features (13 by default).
        batch_size: examples per batch (per rank).
        train_batches: batches an epoch, per rank.
        val_batches: batches of the validation stream (its own new ids).
        head_size: popular ids per feature; their ranks follow a Zipf law.
        zipf_exponent: the exponent of that Zipf law (larger: a more skewed head).
        new_id_fraction: share of lookups that are never-seen ids.
        seed: the stream; the same seed gives the same stream.
        num_workers: DataLoader workers generating batches.

    Example::

        dm = SyntheticStreamDataModule(batch_size=4096, train_batches=10_000, new_id_fraction=0.2)
        Trainer(max_steps=10_000).fit(DLRMModule(embedding_dim=64, storage=...), datamodule=dm)
    """

    def __init__(self, num_sparse: int = 26, num_dense: int = 13, batch_size: int = 4096,
                 train_batches: int = 100_000, val_batches: int = 20, head_size: int = 1_000_000,
                 zipf_exponent: float = 1.05, new_id_fraction: float = 0.2, seed: int = 0, num_workers: int = 1) -> None:
        super().__init__()
        if batch_size < 1 or train_batches < 1 or val_batches < 0:
            raise ValueError(f"batch_size and train_batches must be >= 1, val_batches >= 0; got {batch_size}, "
                             f"{train_batches}, {val_batches}")
        self.save_hyperparameters()
        self.sparse_feature_names = [f"C{i}" for i in range(1, num_sparse + 1)]
        self.num_dense_features = num_dense
        self._resume_batches = 0

    def _stream(self, stream: int, batches: int, first: int = 0) -> StreamLoader:
        h = self.hparams
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        dataset = SyntheticStream(h.num_sparse, h.num_dense, h.batch_size, batches - first, h.head_size,
                                  h.zipf_exponent, h.new_id_fraction, h.seed, stream, rank, world, first)
        return StreamLoader(dataset, num_workers=h.num_workers)

    def train_dataloader(self) -> StreamLoader:
        first, self._resume_batches = self._resume_batches, 0
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        # Every epoch reads on in the stream, so the tables keep growing.
        return self._stream(0, (epoch + 1) * self.hparams.train_batches,
                            epoch * self.hparams.train_batches + first)

    def val_dataloader(self) -> StreamLoader | list:
        return self._stream(1, self.hparams.val_batches) if self.hparams.val_batches else []

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        if trainer is None:
            return {}
        return {"batches": trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_batches = int(state_dict.get("batches", 0))
