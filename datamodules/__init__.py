"""Streaming ad-log DataModules (installed as ``ctr_lightning.datamodules``)."""

from ctr_lightning.datamodules.avazu import AvazuDataModule, AvazuFormat
from ctr_lightning.datamodules.bad_lines import BadLineError, UnreadableFileError
from ctr_lightning.datamodules.criteo import CriteoDataModule, CriteoFormat
from ctr_lightning.datamodules.delimited import DelimitedDataModule, DelimitedFormat
from ctr_lightning.datamodules.drifting_datamodule import DriftingLogDataModule
from ctr_lightning.datamodules.drifting_log import DriftingLog
from ctr_lightning.datamodules.log_datamodule import LogDataModule
from ctr_lightning.datamodules.parquet import ParquetDataModule, ParquetFormat
from ctr_lightning.datamodules.synthetic_datamodule import SyntheticCriteoDataModule
from ctr_lightning.datamodules.synthetic_stream import SyntheticStreamDataModule
from ctr_lightning.datamodules.synthetic_criteo import (
    SyntheticCriteo,
    SyntheticCriteoSpec,
    write_synthetic_criteo,
)

__all__ = [
    "AvazuDataModule",
    "AvazuFormat",
    "BadLineError",
    "CriteoDataModule",
    "CriteoFormat",
    "DelimitedDataModule",
    "DelimitedFormat",
    "DriftingLog",
    "DriftingLogDataModule",
    "LogDataModule",
    "ParquetDataModule",
    "ParquetFormat",
    "SyntheticCriteo",
    "SyntheticCriteoDataModule",
    "SyntheticCriteoSpec",
    "SyntheticStreamDataModule",
    "UnreadableFileError",
    "write_synthetic_criteo",
]
