"""A run on data it cannot read stops with the files and the reason, instead of finishing
"successfully" having trained on nothing."""

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctr_lightning.datamodules import AvazuDataModule, BadLineError, CriteoDataModule, write_synthetic_criteo
from ctr_lightning.datamodules.batch_loader import EmptyEpochError
from ctr_lightning.datamodules.stream_dataset import TooManyBadLinesError
from ctr_lightning.models import DLRMModule

from ..conftest import write_avazu_layout


def fit(dm):
    model = DLRMModule(sparse_feature_names=dm.sparse_feature_names, num_dense_features=dm.num_dense_features,
                       num_embeddings=1000, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    return trainer


def test_an_avazu_csv_given_to_the_criteo_reader_names_the_file_and_the_right_datamodule(tmp_path):
    path = write_avazu_layout(tmp_path / "train.csv", rows=300, seed=0)
    with pytest.raises(TooManyBadLinesError) as error:
        fit(CriteoDataModule(train_paths=[str(path)], batch_size=32))
    message = str(error.value)
    assert str(path) in message and "expected 40 fields" in message
    assert "Avazu CSV header" in message and "AvazuDataModule" in message


def test_a_criteo_file_given_to_the_avazu_reader_fails_at_setup(tmp_path):
    path = write_synthetic_criteo(tmp_path / "day_0.tsv", rows=50, seed=0)
    with pytest.raises(BadLineError, match=rf"{path}:1: expected the Avazu header .*CriteoDataModule"):
        AvazuDataModule(train_paths=[str(path)]).setup("fit")


def test_a_parquet_file_given_to_the_criteo_reader_is_named_as_parquet(tmp_path):
    path = tmp_path / "day_0.tsv"  # a Parquet file under a misleading name
    pq.write_table(pa.table({"click": [0, 1] * 100, "ad": list(range(200))}), path)
    # A few binary "lines" only: every one bad, and the epoch empty.
    with pytest.raises(EmptyEpochError, match=r"day_0.tsv: The file begins with the Parquet magic bytes PAR1: "
                                              r"read it with ParquetDataModule"):
        fit(CriteoDataModule(train_paths=[str(path)], batch_size=32))


def test_garbage_fails_and_empty_files_are_no_training(tmp_path):
    garbage = tmp_path / "garbage.tsv"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8).tobytes())
    with pytest.raises(TooManyBadLinesError, match=r"garbage.tsv: \d+ of the \d+ lines read .*are bad"):
        fit(CriteoDataModule(train_paths=[str(garbage)], batch_size=32))
    (tmp_path / "a.tsv").write_bytes(b"")
    (tmp_path / "b.tsv").write_bytes(b"")
    with pytest.raises(EmptyEpochError, match=r"yielded no training example: the files hold no record: .*a.tsv.*b.tsv"):
        fit(CriteoDataModule(train_paths=[str(tmp_path / "a.tsv"), str(tmp_path / "b.tsv")], batch_size=32))


def test_the_tolerated_share_of_bad_lines_is_a_setting(tmp_path):
    lines = write_synthetic_criteo(tmp_path / "src.tsv", rows=1000, seed=0).read_text().splitlines()
    for i in range(0, 1000, 20):  # 5% of the lines lose a field
        lines[i] = lines[i].rsplit("\t", 1)[0]
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TooManyBadLinesError, match=r"50 of the 1000 lines read (so far )?are bad.*max_bad_fraction=0.01"):
        fit(CriteoDataModule(train_paths=[str(path)], batch_size=100, max_bad_fraction=0.01))
    dm = CriteoDataModule(train_paths=[str(path)], batch_size=100, max_bad_fraction=0.1)
    assert fit(dm).global_step == 10  # 950 good rows
    assert dm.bad_line_counts == {str(path): 50}


def test_the_command_line_exits_with_the_reason(tmp_path, in_process):
    path = write_avazu_layout(tmp_path / "train.csv", rows=300, seed=0)
    with pytest.raises(TooManyBadLinesError, match="AvazuDataModule"):
        in_process(["fit", "--config", "configs/criteo.yaml", "--data.train_paths", f"[{path}]",
                    "--trainer.max_epochs", "1", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                    "--trainer.enable_progress_bar", "false", "--data.num_workers", "0"])
