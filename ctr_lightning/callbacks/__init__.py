"""Lightning callbacks for CTR training runs."""

from ctr_lightning.callbacks.auto_placement import AutoPlacement, auto_placement_by_default
from ctr_lightning.callbacks.bad_line_monitor import BadLineMonitor
from ctr_lightning.callbacks.working_set_prefetch import WorkingSetPrefetch
from ctr_lightning.callbacks.progressive_validation import ProgressiveValidation
from ctr_lightning.callbacks.stream_progress_bar import StreamProgressBar
from ctr_lightning.callbacks.run_summary import RunSummary
from ctr_lightning.callbacks.score_writer import ScoreWriter
from ctr_lightning.callbacks.serving_exports import ServingExport
from ctr_lightning.callbacks.storage_monitor import StorageMonitor
from ctr_lightning.callbacks.table_snapshots import TableSnapshots, table_snapshots_by_default
from ctr_lightning.callbacks.examples_per_second import ExamplesPerSecond
from ctr_lightning.callbacks.hyperparameter_table import HyperparameterTable
from ctr_lightning.callbacks.short_run_logging import ShortRunLogging

__all__ = ["AutoPlacement", "BadLineMonitor", "ExamplesPerSecond", "HyperparameterTable", "ProgressiveValidation",
           "RunSummary", "ScoreWriter", "ServingExport", "ShortRunLogging", "StorageMonitor", "StreamProgressBar", "TableSnapshots", "WorkingSetPrefetch", "auto_placement_by_default",
           "table_snapshots_by_default"]
