"""Lightning callbacks for CTR training runs."""

from ctr_lightning.callbacks.data_quality import BadLineMonitor
from ctr_lightning.callbacks.working_set_prefetch import WorkingSetPrefetch
from ctr_lightning.callbacks.progress import StreamProgressBar
from ctr_lightning.callbacks.run_summary import RunSummary
from ctr_lightning.callbacks.score_writer import ScoreWriter
from ctr_lightning.callbacks.storage_monitor import StorageMonitor
from ctr_lightning.callbacks.table_snapshots import TableSnapshots, table_snapshots_by_default
from ctr_lightning.callbacks.throughput import ExamplesPerSecond

__all__ = ["BadLineMonitor", "ExamplesPerSecond", "RunSummary", "ScoreWriter", "StorageMonitor",
           "StreamProgressBar", "TableSnapshots", "WorkingSetPrefetch", "table_snapshots_by_default"]
