"""Criteo-layout logs generated on first use: the demo's data, needing no download."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

from ctr_lightning.datamodules.criteo import CriteoDataModule
from ctr_lightning.datamodules.synthetic_criteo import SyntheticCriteo, SyntheticCriteoSpec


class SyntheticCriteoDataModule(CriteoDataModule):
    """Writes synthetic Criteo logs under ``data_dir`` in ``prepare_data``, then streams them.

    Train and validation are independent samples of one planted click model. Files are
    named after their parameters and reused by later runs.

    Args:
        data_dir: where the files go (git-ignored ``data/`` by default).
        train_rows: rows of the training file.
        val_rows: rows of the validation file.
        seed: the planted world.
        max_cardinality: cap on the Criteo Kaggle cardinalities.
        zipf_exponent: skew of value frequencies.
        batch_size, num_workers, bad_lines, bad_files, block_size: as :class:`CriteoDataModule`.

    Example::

        dm = SyntheticCriteoDataModule(train_rows=100_000, val_rows=20_000)
        Trainer(max_epochs=1).fit(DLRMModule(), datamodule=dm)
    """

    def __init__(
        self,
        data_dir: str = "data/synthetic_criteo",
        train_rows: int = 1_000_000,
        val_rows: int = 100_000,
        seed: int = 0,
        max_cardinality: int = 100_000,
        zipf_exponent: float = 1.1,
        batch_size: int = 4096,
        num_workers: int = 0,
        bad_lines: str = "skip",
        bad_files: str = "fail",
        block_size: int = 1 << 19,
    ) -> None:
        if train_rows < 1 or val_rows < 0:
            raise ValueError(f"train_rows must be >= 1 and val_rows >= 0, got {train_rows}, {val_rows}")
        self.spec = SyntheticCriteoSpec(seed=seed, max_cardinality=max_cardinality, zipf_exponent=zipf_exponent)
        world = Path(data_dir) / f"seed{seed}-card{max_cardinality}-zipf{zipf_exponent:g}"
        self.train_file = world / f"train-{train_rows}.tsv"
        self.val_file = world / f"val-{val_rows}.tsv" if val_rows else None
        self.rows = {self.train_file: (train_rows, 0)}
        if self.val_file is not None:
            self.rows[self.val_file] = (val_rows, 1)
        super().__init__(
            train_paths=[str(self.train_file)],
            val_paths=[str(self.val_file)] if self.val_file else None,
            batch_size=batch_size,
            num_workers=num_workers,
            bad_lines=bad_lines,
            bad_files=bad_files,
            block_size=block_size,
        )
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        generator = SyntheticCriteo(self.spec)
        for path, (rows, stream) in self.rows.items():
            if path.exists():
                continue
            rank_zero_info(f"Writing {rows:,} synthetic Criteo rows to {path} ...")
            generator.write(path, rows, stream=stream)
