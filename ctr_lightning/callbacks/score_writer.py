"""Streams predicted click probabilities to files, batch by batch, on every rank."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np

from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info

FORMATS = ("tsv", "parquet")


class ScoreWriter(BasePredictionWriter):
    """Writes every predicted batch at once, so memory stays constant however many rows
    are scored: one file per rank, ``scores-rank<r>.<tsv|parquet>`` in ``output_dir``,
    with columns ``row`` (the example's place among the predict files' records, 0-based,
    file after file, header lines not counted; a rank-local count when the data gives none),
    ``label`` (empty, or null in Parquet, for unlabeled data) and ``score`` (the click probability). Files are
    written under a ``.partial`` name and renamed when the pass completes.

    ``ctr-lightning predict`` adds one (to ``<default_root_dir>/predictions``) unless the
    config names a prediction writer, and keeps no predictions in memory.

    Example::

        trainer = Trainer(callbacks=[ScoreWriter("scores", file_format="parquet")])
        trainer.predict(model, datamodule=dm, return_predictions=False)
    """

    def __init__(self, output_dir: str = "predictions", file_format: str = "tsv",
                 rows_per_write: int = 1 << 16) -> None:
        super().__init__(write_interval="batch")
        if file_format not in FORMATS:
            raise ValueError(f"ScoreWriter: file_format must be one of {FORMATS}, got {file_format!r}")
        self.output_dir = Path(output_dir)
        self.file_format = file_format
        self.rows_per_write = rows_per_write
        self.path: Path | None = None
        self.rows_written = 0
        self._file: Any = None
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending_rows = 0
        self._next_row = 0

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / f"scores-rank{trainer.global_rank:05d}.{self.file_format}"
        if trainer.global_rank == 0:
            # An earlier pass with more ranks or the other format must not leave files that a
            # reader of scores-rank* would mix in: this pass writes ranks < world_size only.
            for old in self.output_dir.glob("scores-rank*"):
                match = re.fullmatch(r"scores-rank(\d+)\.(tsv|parquet)(\.partial)?", old.name)
                if match and (match.group(2) != self.file_format or int(match.group(1)) >= trainer.world_size):
                    old.unlink(missing_ok=True)
        self.rows_written, self._next_row = 0, 0
        self._pending, self._pending_rows = [], 0
        self._file = None

    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: Any,
                           batch_indices: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        scores = prediction.detach().float().cpu().numpy().reshape(-1)
        records = getattr(batch, "records", None)
        if records is None:
            rows = np.arange(self._next_row, self._next_row + len(scores), dtype=np.int64)
        else:
            rows = records.cpu().numpy()
        self._next_row += len(scores)
        labels = batch.labels.detach().float().cpu().numpy().reshape(-1)
        if len(rows) != len(scores) or len(labels) != len(scores):
            raise ValueError(f"ScoreWriter: batch {batch_idx} has {len(scores)} scores for {len(rows)} rows and "
                             f"{len(labels)} labels; predict_step must return one score per example")
        self._pending.append((rows, labels, scores))
        self._pending_rows += len(scores)
        if self._pending_rows >= self.rows_per_write:
            self._flush()

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()
        if self._file is None:
            self._open()  # a rank with nothing to score still leaves its (empty) file
        self._file.close()
        self._file = None
        os.replace(self._partial(), self.path)
        rank_zero_info(f"ScoreWriter: {self.rows_written} scores of rank 0 in {self.path} "
                       f"({trainer.world_size} file(s) in {self.output_dir})")

    def _partial(self) -> Path:
        return self.path.with_name(self.path.name + ".partial")

    def _open(self) -> None:
        if self.file_format == "tsv":
            self._file = open(self._partial(), "w", encoding="ascii")
            self._file.write("row\tlabel\tscore\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = pa.schema([("row", pa.int64()), ("label", pa.float32()), ("score", pa.float32())])
            self._file = pq.ParquetWriter(str(self._partial()), schema)

    def _flush(self) -> None:
        if not self._pending:
            return
        if self._file is None:
            self._open()
        rows, labels, scores = (np.concatenate(column) for column in zip(*self._pending))
        self._pending, self._pending_rows = [], 0
        if self.file_format == "tsv":
            label_text = np.where(np.isnan(labels), "", np.char.mod("%g", labels))
            lines = np.char.add(np.char.add(np.char.add(np.char.add(rows.astype(str), "\t"), label_text), "\t"),
                                np.char.mod("%.7g", scores))
            self._file.write("\n".join(lines.tolist()) + "\n")
        else:
            import pyarrow as pa

            self._file.write_table(pa.table({"row": rows,
                                             "label": pa.array(labels.astype(np.float32), mask=np.isnan(labels)),
                                             "score": scores.astype(np.float32)}))
        self.rows_written += len(rows)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()  # Lightning skips callbacks' teardown when a run fails

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        """An interrupted pass: its file stays ``.partial``; what was not written is dropped."""
        self._pending, self._pending_rows = [], 0
        if self._file is not None:
            self._file.close()
            self._file = None


