"""Lightning callbacks for CTR training runs."""

from ctr_lightning.callbacks.run_summary import RunSummary
from ctr_lightning.callbacks.throughput import ExamplesPerSecond

__all__ = ["ExamplesPerSecond", "RunSummary"]
