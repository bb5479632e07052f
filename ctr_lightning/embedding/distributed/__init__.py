"""The engines of a collection sharded over the ranks of a process group, and their collectives.

:class:`ShardedTables` keeps each row on its owner and moves ids and pooled embeddings
every step; :class:`KStepTables` trains local copies and merges them at the owners
every k steps. The single-process path (:mod:`ctr_lightning.embedding.local_tables`)
knows nothing of ranks.
"""

from ctr_lightning.embedding.distributed.kstep_tables import KStepTables
from ctr_lightning.embedding.distributed.sharded_tables import ShardedTables

__all__ = ["KStepTables", "ShardedTables"]
